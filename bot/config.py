"""The bot's settings, read from the environment (CONTRACTS.md, "The bot") and checked up front."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlparse

from hangdx.bot.diagnosis import DiagnosisError, check_resolver

DEFAULT_API_URL = "https://slack.com/api/"
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
_CHANNEL = re.compile(r"^[CGD][A-Z0-9]{2,}$")
_USER = re.compile(r"^[UW][A-Z0-9]{2,}$")
_GROUP = re.compile(r"^S[A-Z0-9]{2,}$")
SETTINGS = (
    "SLACK_BOT_TOKEN", "SLACK_SIGNING_SECRET", "SLACK_APP_TOKEN", "SLACK_API_URL", "REDIS_URL",
    "HANGDX_ALERT_CHANNEL", "HANGDX_ALERT_TOKEN", "HANGDX_RESOLVER", "HANGDX_ALLOWED_USERS",
    "HANGDX_ALLOWED_CHANNELS", "HANGDX_ALLOWED_GROUPS", "HANGDX_HANDOFF_TIME", "HANGDX_HANDOFF_CHANNEL",
    "HANGDX_ALERT_JOB_LABELS", "HANGDX_ACTION_USERS", "HANGDX_ACTION_GROUPS",
)  # fmt: skip
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")  # a Prometheus label name
# Alert labels that carry the training job's id: never Prometheus's own `job` (the scrape job, on every alert).
# `hpc_job` is what DCGM exporter's HPC job mapping (--hpc-job-mapping-dir) adds to its metrics.
DEFAULT_JOB_LABELS = ("job_id", "slurm_job_id", "hangdx_job_id", "hpc_job")
_HHMM = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])$")


def is_channel_id(value: object) -> bool:
    """A Slack channel id (C..., G..., D...), nothing else (no newline, no mrkdwn)."""
    return isinstance(value, str) and _CHANNEL.fullmatch(value) is not None


def int_setting(name: str, default: int) -> int:
    """A positive whole number from the environment; the default when it is unset or not one."""
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


class ConfigError(Exception):
    """A setting is missing or malformed: one line naming the variable."""


def load_file(path: str) -> dict[str, str]:
    """HANGDX_CONFIG: a YAML mapping of the same names as the environment variables (lists allowed)."""
    import yaml

    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"HANGDX_CONFIG: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"HANGDX_CONFIG: {path} is not YAML: {str(e).splitlines()[0]}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"HANGDX_CONFIG: {path} must be a mapping of settings, not {type(doc).__name__}")
    out = {}
    for key, value in doc.items():
        if key not in SETTINGS:
            raise ConfigError(
                f"HANGDX_CONFIG: unknown setting {key!r} in {path} (known: {', '.join(SETTINGS)})"
            )
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ConfigError(f"HANGDX_CONFIG: {key} in {path} must be a string")
        out[key] = str(value)
    return out


def _list(raw: str | None, name: str, pattern: re.Pattern[str]) -> frozenset[str]:
    items = [x.strip() for x in (raw or "").split(",") if x.strip()]
    for item in items:
        if not pattern.fullmatch(item):
            raise ConfigError(f"{name}: {item!r} is not a Slack id")
    return frozenset(items)


@dataclass(frozen=True)
class BotConfig:
    bot_token: str | None = None
    signing_secret: str | None = None
    app_token: str | None = None
    api_url: str = DEFAULT_API_URL
    redis_url: str = DEFAULT_REDIS_URL
    alert_channel: str | None = None
    alert_token: str | None = None
    resolver: str = "local"
    allowed_users: frozenset[str] = field(default_factory=frozenset)  # empty = everyone
    allowed_channels: frozenset[str] = field(default_factory=frozenset)  # empty = everywhere
    handoff_time: str | None = None  # "HH:MM" UTC: post the on-call hand-off daily then
    handoff_channel: str | None = None  # defaults to alert_channel
    allowed_groups: frozenset[str] = field(
        default_factory=frozenset
    )  # user groups (S...) whose members may act
    # Who is in a user group: set by the Slack app (usergroups.users.list), cached there.
    group_members: Callable[[str], frozenset[str]] | None = field(default=None, repr=False, compare=False)
    alert_job_labels: tuple[str, ...] = DEFAULT_JOB_LABELS
    # Who may drain nodes and requeue or cancel jobs from Slack (empty: nobody): apart from who may diagnose.
    action_users: frozenset[str] = field(default_factory=frozenset)
    action_groups: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BotConfig:
        """Read and check every variable; raise ConfigError on the first bad one."""
        env: Mapping[str, str] = os.environ if environ is None else environ
        if (env.get("HANGDX_CONFIG") or "").strip():
            # The file gives defaults; the environment always wins (CONTRACTS.md: "these always work").
            from_file = load_file(env["HANGDX_CONFIG"].strip())
            env = {**from_file, **{k: v for k, v in env.items() if v}}

        def get(name: str) -> str | None:
            return (env.get(name) or "").strip() or None

        bot_token = get("SLACK_BOT_TOKEN")
        if bot_token and not bot_token.startswith("xoxb-"):
            raise ConfigError("SLACK_BOT_TOKEN: expected a bot token (xoxb-...)")
        app_token = get("SLACK_APP_TOKEN")
        if app_token and not app_token.startswith("xapp-"):
            raise ConfigError("SLACK_APP_TOKEN: expected an app-level token (xapp-...)")
        api_url = get("SLACK_API_URL") or DEFAULT_API_URL
        u = urlparse(api_url)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise ConfigError(f"SLACK_API_URL: {api_url!r} is not an http(s) URL")
        redis_url = get("REDIS_URL") or DEFAULT_REDIS_URL
        if urlparse(redis_url).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(f"REDIS_URL: {redis_url!r} is not a redis://, rediss:// or unix:// URL")
        alert_channel = get("HANGDX_ALERT_CHANNEL")
        if alert_channel and not _CHANNEL.fullmatch(alert_channel):
            raise ConfigError(f"HANGDX_ALERT_CHANNEL: {alert_channel!r} is not a channel id (C...)")
        alert_token = get("HANGDX_ALERT_TOKEN")
        if alert_token and len(alert_token) < 16:
            raise ConfigError("HANGDX_ALERT_TOKEN: use at least 16 characters")
        handoff_time = get("HANGDX_HANDOFF_TIME")
        if handoff_time and not _HHMM.fullmatch(handoff_time):
            raise ConfigError(f"HANGDX_HANDOFF_TIME: {handoff_time!r} is not a UTC time HH:MM (00:00-23:59)")
        handoff_channel = get("HANGDX_HANDOFF_CHANNEL")
        if handoff_channel and not _CHANNEL.fullmatch(handoff_channel):
            raise ConfigError(f"HANGDX_HANDOFF_CHANNEL: {handoff_channel!r} is not a channel id (C...)")
        handoff_channel = handoff_channel or alert_channel
        if handoff_time and not handoff_channel:
            raise ConfigError(
                "HANGDX_HANDOFF_TIME is set but neither HANGDX_HANDOFF_CHANNEL nor HANGDX_ALERT_CHANNEL is"
            )
        labels = tuple(x.strip() for x in (get("HANGDX_ALERT_JOB_LABELS") or "").split(",") if x.strip())
        for label in labels:
            if not _LABEL.fullmatch(label):
                raise ConfigError(f"HANGDX_ALERT_JOB_LABELS: {label[:40]!r} is not a Prometheus label name")
        try:
            resolver = check_resolver(get("HANGDX_RESOLVER") or "local")
        except DiagnosisError as e:
            raise ConfigError(f"HANGDX_RESOLVER: {e}") from None
        return cls(
            bot_token=bot_token,
            signing_secret=get("SLACK_SIGNING_SECRET"),
            app_token=app_token,
            # WebClient joins method names onto base_url: it must end with a slash.
            api_url=api_url.rstrip("/") + "/",
            redis_url=redis_url,
            alert_channel=alert_channel,
            alert_token=alert_token,
            resolver=resolver,
            allowed_users=_list(env.get("HANGDX_ALLOWED_USERS"), "HANGDX_ALLOWED_USERS", _USER),
            allowed_channels=_list(env.get("HANGDX_ALLOWED_CHANNELS"), "HANGDX_ALLOWED_CHANNELS", _CHANNEL),
            handoff_time=handoff_time,
            handoff_channel=handoff_channel,
            allowed_groups=_list(env.get("HANGDX_ALLOWED_GROUPS"), "HANGDX_ALLOWED_GROUPS", _GROUP),
            alert_job_labels=labels or DEFAULT_JOB_LABELS,
            action_users=_list(env.get("HANGDX_ACTION_USERS"), "HANGDX_ACTION_USERS", _USER),
            action_groups=_list(env.get("HANGDX_ACTION_GROUPS"), "HANGDX_ACTION_GROUPS", _GROUP),
        )

    def require_slack(self) -> None:
        """`serve` needs the app's credentials; the CLI does not."""
        if not self.bot_token:
            raise ConfigError("SLACK_BOT_TOKEN is not set")
        if not self.signing_secret and not self.app_token:
            raise ConfigError("SLACK_SIGNING_SECRET is not set (or set SLACK_APP_TOKEN for Socket Mode)")

    def action_refusal(self, user: str | None) -> str | None:
        """Why this user may not drain, requeue or cancel (a right apart from diagnosing), or None."""
        if not (self.action_users or self.action_groups):
            return (
                "Slurm actions are off on this server (HANGDX_ACTION_USERS, HANGDX_ACTION_GROUPS are empty)."
            )
        if user in self.action_users:
            return None
        if (
            self.group_members is not None
            and user
            and any(user in self.group_members(g) for g in sorted(self.action_groups))
        ):
            return None
        return (
            "You may not drain nodes or requeue or cancel jobs (HANGDX_ACTION_USERS, HANGDX_ACTION_GROUPS)."
        )

    def _allowed(self, user: str | None) -> bool:
        if user in self.allowed_users:
            return True
        if not self.allowed_groups or self.group_members is None or not user:
            return False
        return any(user in self.group_members(g) for g in sorted(self.allowed_groups))

    def refusal(self, user: str | None, channel: str | None) -> str | None:
        """Why this user in this channel may not use the bot, or None when they may."""
        if (self.allowed_users or self.allowed_groups) and not self._allowed(user):
            return (
                "You are not on hangdx's list of allowed users or groups (HANGDX_ALLOWED_USERS, "
                "HANGDX_ALLOWED_GROUPS); ask the on-call lead."
            )
        if self.allowed_channels and channel not in self.allowed_channels:
            return "hangdx does not run diagnoses in this channel (HANGDX_ALLOWED_CHANNELS); use an on-call channel."
        return None
