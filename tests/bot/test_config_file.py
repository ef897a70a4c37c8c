"""The bot's settings from a file (HANGDX_CONFIG) under the environment, and user-group allowlists."""

from __future__ import annotations

import dataclasses

import pytest

from hangdx.bot.config import BotConfig, ConfigError


def test_file_gives_defaults_and_the_environment_wins(tmp_path):
    f = tmp_path / "hangdx.yaml"
    f.write_text(
        "SLACK_BOT_TOKEN: xoxb-from-file-1\n"
        "HANGDX_ALERT_CHANNEL: C0FROMFILE\n"
        "HANGDX_ALLOWED_USERS: [U0ONE, U0TWO]\n"
        "HANGDX_RESOLVER: slurm\n"
    )
    cfg = BotConfig.from_env({"HANGDX_CONFIG": str(f), "SLACK_BOT_TOKEN": "xoxb-from-env-2"})
    assert cfg.bot_token == "xoxb-from-env-2"
    assert cfg.alert_channel == "C0FROMFILE" and cfg.resolver == "slurm"
    assert cfg.allowed_users == {"U0ONE", "U0TWO"}


@pytest.mark.parametrize(
    "text, words",
    [
        ("- a\n- b\n", "must be a mapping"),
        ("SLACK_BOT_TOKEN: [unclosed\n", "is not YAML"),
        ("SLACK_BOT_TOKN: xoxb-1\n", "unknown setting 'SLACK_BOT_TOKN'"),
        ("SLACK_BOT_TOKEN: {a: 1}\n", "must be a string"),
        ("HANGDX_RESOLVER: '$(reboot)'\n", "HANGDX_RESOLVER"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_problem(tmp_path, text, words):
    f = tmp_path / "hangdx.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        BotConfig.from_env({"HANGDX_CONFIG": str(f)})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_missing_file_is_one_line():
    with pytest.raises(ConfigError, match="cannot read /nonexistent/hangdx.yaml"):
        BotConfig.from_env({"HANGDX_CONFIG": "/nonexistent/hangdx.yaml"})


def test_members_of_an_allowed_group_may_act_others_may_not():
    cfg = BotConfig.from_env({"HANGDX_ALLOWED_GROUPS": "S0ONCALL", "HANGDX_ALLOWED_USERS": "U0LEAD"})
    asked: list[str] = []

    def members(group: str) -> frozenset[str]:
        asked.append(group)
        return frozenset({"U0ONCALL1"}) if group == "S0ONCALL" else frozenset()

    cfg = dataclasses.replace(cfg, group_members=members)
    assert cfg.refusal("U0LEAD", "C0ANY") is None
    assert cfg.refusal("U0ONCALL1", "C0ANY") is None and asked == ["S0ONCALL"]
    assert "HANGDX_ALLOWED_GROUPS" in cfg.refusal("U0STRANGER", "C0ANY")
    with pytest.raises(ConfigError, match="HANGDX_ALLOWED_GROUPS"):
        BotConfig.from_env({"HANGDX_ALLOWED_GROUPS": "U0NOTAGROUP"})
