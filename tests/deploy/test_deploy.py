"""The deployment files under deploy/ (image, compose, Kubernetes, systemd), checked against what hangdx
really accepts and does: every command a container or unit runs is parsed by hangdx's own command line, every
setting by BotConfig, the inventory by the inventory resolver; the Redis configuration is run by a real
redis-server and must keep its data across a restart; the compose commands start a real bot and worker whose
health the image's own HEALTHCHECK command judges; the lock file is read with tomllib and packaging against
pyproject.toml. Docker cannot run here: the Dockerfile is parsed. kubectl (kustomize), kubernetes-validate and
systemd-analyze are used when present."""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse

import pytest
import redis
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from hangdx.bot.cli import _parser
from hangdx.bot.config import SETTINGS, BotConfig, ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slack_standin import SlackStandin  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
DOCKERFILE = DEPLOY / "Dockerfile"
ENV_EXAMPLE = DEPLOY / "hangdx.env.example"
LOCK = DEPLOY / "requirements.lock"
REDIS = shutil.which("redis-server")

CREDENTIALS = {"SLACK_BOT_TOKEN", "SLACK_SIGNING_SECRET", "SLACK_APP_TOKEN", "HANGDX_ALERT_TOKEN"}
PLACEHOLDER = re.compile(r"^(replace-with-[a-z0-9-]+)?$")
# What a team puts in place of each placeholder (valid in form, not real).
FILLED = {
    "SLACK_BOT_TOKEN": "xoxb-1111-2222-hangdxtest",
    "SLACK_SIGNING_SECRET": "8f742231b10e8888abcd99yyyzzz85a5",
    "HANGDX_ALERT_TOKEN": "alert-token-0123456789abcdef",
    "HANGDX_ALERT_CHANNEL": "C0ALERTS01",
}
SECRET_VALUES = [
    ("a Slack token", re.compile(r"xox[abposr]-\d+-[0-9A-Za-z-]+")),
    ("a Slack app-level token", re.compile(r"xapp-\d-[0-9A-Za-z]+-")),
    ("a private key", re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----")),
    ("a Slack signing secret (32 hex digits)", re.compile(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")),
]


# -- reading the files ------------------------------------------------------------------------------------


def yaml_docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def dotenv(path: Path) -> dict[str, str]:
    """KEY=value lines, read the way docker compose, systemd's EnvironmentFile= and kustomize all agree on."""
    out: dict[str, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z][A-Z0-9_]*", key), f"{path.name}:{n}: not KEY=value: {line!r}"
        # Quotes, spaces and inline comments are read differently by compose, systemd and kustomize.
        assert not re.search(r"[\s'\"#\\]", value), f"{path.name}:{n}: {key}'s value needs quoting: {value!r}"
        assert key not in out, f"{path.name}:{n}: {key} twice"
        out[key] = value
    return out


def _gitignored(path: Path) -> bool:
    """deploy/.gitignore's patterns (anchored names): a deployment's own secrets are never scanned or shipped."""
    rel = path.relative_to(DEPLOY).as_posix()
    pats = [p.strip() for p in (DEPLOY / ".gitignore").read_text().splitlines() if p.strip()]
    return any(
        rel == p.strip("/") or rel.startswith(p.strip("/") + "/") for p in pats if not p.startswith("#")
    )


def deploy_files(ours_only: bool = False) -> list[Path]:
    """The files under deploy/, less a deployment's own (git-ignored); ours_only: less deploy/node/ too."""
    files = (p for p in DEPLOY.rglob("*") if p.is_file() and not _gitignored(p))
    return sorted(p for p in files if not (ours_only and p.relative_to(DEPLOY).parts[0] == "node"))


def parse_cli(argv: list[str]):
    """hangdx's own parser on a container's or unit's arguments; a bad flag fails the test with argparse's words."""
    try:
        return _parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`hangdx {shlex.join(argv)}` is not a valid hangdx command line (see stderr)")


def readme_settings() -> set[str]:
    """The variable names of README.md's settings table (a superset of CONTRACTS.md's)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### 2. Configure", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1])}


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text(encoding="utf-8"))


def filled(env: dict[str, str]) -> dict[str, str]:
    """The example environment with every placeholder replaced as the instructions say."""
    out = dict(env)
    for key, value in env.items():
        if value.startswith("replace-with-"):
            assert key in FILLED, f"{key} has a placeholder this test does not know how to fill"
            out[key] = FILLED[key]
    return out


# -- Dockerfile ---------------------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        instr, _, rest = (buf + s).partition(" ")
        out.append((instr.upper(), rest.strip()))
        buf = ""
    assert not buf, "the Dockerfile ends inside a continued line"
    return out


def stages() -> list[list[tuple[str, str]]]:
    """The build stages, each starting with its FROM; ARGs before the first FROM resolved in FROM lines."""
    args: dict[str, str] = {}
    out: list[list[tuple[str, str]]] = []
    for instr, rest in dockerfile():
        if instr == "ARG" and not out:
            name, _, default = rest.partition("=")
            args[name] = default
            continue
        if instr == "FROM":
            rest = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest)
            out.append([])
        assert out, f"{instr} before FROM"
        out[-1].append((instr, rest))
    return out


def runtime() -> list[tuple[str, str]]:
    return stages()[-1]


def image_user() -> tuple[int, int]:
    users = [rest for instr, rest in runtime() if instr == "USER"]
    assert users, "the runtime stage sets no USER: it would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and gid.isdigit(), f"USER {users[-1]}: use a numeric uid:gid (Kubernetes checks it)"
    return int(uid), int(gid)


def image_home() -> str:
    env = " ".join(rest for instr, rest in runtime() if instr == "ENV")
    m = re.search(r"\bHOME=(\S+)", env)
    assert m, "the image sets no HOME: paramiko looks for ~/.ssh"
    return m.group(1)


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


def healthcheck() -> list[str]:
    (rest,) = [rest for instr, rest in runtime() if instr == "HEALTHCHECK"]
    return exec_form(rest.split("CMD ", 1)[1])


def dockerignore_excludes(rel: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides; ! re-includes."""

    def rx(pattern: str) -> re.Pattern[str]:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            elif pattern[i] == "[":
                j = pattern.index("]", i)
                out, i = out + pattern[i : j + 1], j + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out)

    parts = rel.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = rx(line.lstrip("!").strip("/"))
        if any(pattern.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


# -- Kubernetes ---------------------------------------------------------------------------------------------


def kustomize(d: Path = K8S) -> tuple[list[dict], set[Path]]:
    """The objects a kustomization makes (generated ConfigMaps included, names unhashed) and the files it reads."""
    k = yaml.safe_load((d / "kustomization.yaml").read_text(encoding="utf-8"))
    files = {d / "kustomization.yaml"}
    objects: list[dict] = []
    for res in k.get("resources", []):
        files.add(d / res)
        objects += yaml_docs(d / res)
    for comp in k.get("components", []):
        sub_objects, sub_files = kustomize(d / comp)
        objects += sub_objects
        files |= sub_files
    for gen in k.get("configMapGenerator", []):
        data: dict[str, str] = {}
        for env in gen.get("envs", []):
            files.add(d / env)
            data.update(dotenv(d / env))
        for spec in gen.get("files", []):
            key, _, path = spec.rpartition("=")
            files.add(d / path)
            data[key or Path(path).name] = (d / path).read_text(encoding="utf-8")
        objects.append(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}
        )
    for obj in objects:
        if k.get("namespace") and obj["kind"] != "Namespace":
            obj["metadata"].setdefault("namespace", k["namespace"])
    return objects, files


def secret_example() -> dict:
    (secret,) = yaml_docs(K8S / "secret.example.yaml")
    return secret


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet")}


def pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_port(container: dict, port: int | str) -> int:
    """A probe's or Service's port (a number or a port name) as the container's port number."""
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    if isinstance(port, int):
        assert port in ports.values(), f"{container['name']} does not expose port {port}"
        return port
    assert port in ports, f"{container['name']} has no port named {port!r}"
    return ports[port]


def reference_problems(objects: list[dict], secret: dict) -> list[str]:
    """Every Secret/ConfigMap key, volume and mount a pod names must exist (the Secret is the example's)."""
    configmaps = {n: set(o.get("data", {})) for n, o in by_kind(objects, "ConfigMap").items()}
    text = (K8S / "secret.example.yaml").read_text(encoding="utf-8")
    secrets = {secret["metadata"]["name"]: set(secret.get("stringData", {}))}
    mentioned = set(re.findall(r"^\s*#?\s*([A-Za-z][\w.-]*):", text, re.M))  # optional keys, commented out
    problems: list[str] = []
    used_secret_keys: set[str] = set()

    def need(kind: str, store: dict[str, set[str]], name: str, key: str | None, optional: bool, where: str):
        if name not in store:
            problems.append(f"{where}: {kind} {name!r} is not defined")
        elif (
            key is not None
            and key not in store[name]
            and not (optional and kind == "Secret" and key in mentioned)
        ):
            problems.append(f"{where}: {kind} {name!r} has no key {key!r}")
        if kind == "Secret" and key is not None:
            used_secret_keys.add(key)

    for wname, w in workloads(objects).items():
        spec = pod(w)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in w["spec"].get("volumeClaimTemplates", [])}
        mounted: set[str] = set()
        for c in spec["containers"]:
            where = f"{wname}/{c['name']}"
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                for kind, store, field in (
                    ("Secret", secrets, "secretKeyRef"),
                    ("ConfigMap", configmaps, "configMapKeyRef"),
                ):
                    if field in ref:
                        r = ref[field]
                        need(
                            kind,
                            store,
                            r["name"],
                            r["key"],
                            r.get("optional", False),
                            f"{where} env {e['name']}",
                        )
            for src in c.get("envFrom", []):
                if "configMapRef" in src:
                    need(
                        "ConfigMap", configmaps, src["configMapRef"]["name"], None, False, f"{where} envFrom"
                    )
                if "secretRef" in src:
                    need("Secret", secrets, src["secretRef"]["name"], None, False, f"{where} envFrom")
            for m in c.get("volumeMounts", []):
                mounted.add(m["name"])
                if m["name"] not in volumes and m["name"] not in claims:
                    problems.append(f"{where}: mounts {m['name']!r}, which is no volume of the pod")
        for vname, v in volumes.items():
            where = f"{wname} volume {vname}"
            if vname not in mounted:
                problems.append(f"{where}: mounted by no container")
            sources = v.get("projected", {}).get("sources", []) + [
                {k: v[k]} for k in ("secret", "configMap") if k in v
            ]
            for src in sources:
                if "secret" in src:
                    s = src["secret"]
                    name = s.get("name") or s.get("secretName")
                    for item in s.get("items") or [{"key": k} for k in secrets.get(name, ())]:
                        need("Secret", secrets, name, item["key"], s.get("optional", False), where)
                if "configMap" in src:
                    cm = src["configMap"]
                    for item in cm.get("items") or [None]:
                        need("ConfigMap", configmaps, cm["name"], item and item["key"], False, where)
        for claim in claims - mounted:
            problems.append(f"{wname}: volumeClaimTemplate {claim!r} mounted by no container")
    unused = secrets[secret["metadata"]["name"]] - used_secret_keys
    if unused:
        problems.append(f"secret.example.yaml has keys no pod uses: {sorted(unused)}")
    return problems


# -- processes ----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"{proc.args} did not stop within {timeout} s of signal {sig}") from None


def wait_for(what: str, cond, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def redis_server(args: list[str], data: Path) -> Iterator[str]:
    """redis-server with a deployment's arguments, on a free loopback port, its files in `data`."""
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    assert args[0] == "redis-server", args
    port = free_port()
    data.mkdir(exist_ok=True)
    cmd = [REDIS, *args[1:], "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5)

        def up() -> bool:
            assert proc.poll() is None, f"redis-server {shlex.join(args[1:])} exited with {proc.returncode}"
            try:
                return bool(client.ping())
            except redis.exceptions.ConnectionError:
                return False

        wait_for("redis-server to answer", up, timeout=10)
        yield url
    finally:
        stop(proc, signal.SIGKILL, timeout=10)


# == tests ==================================================================================================


def test_every_yaml_file_under_deploy_parses() -> None:
    files = [p for p in deploy_files() if p.suffix in (".yaml", ".yml")]
    assert {"compose.yaml", "kustomization.yaml", "slack-app-manifest.yaml"} <= {p.name for p in files}
    for path in files:
        assert yaml_docs(path), f"{path.relative_to(ROOT)} is empty"


def test_no_credential_is_written_anywhere_in_deploy() -> None:
    for path in deploy_files() + [ROOT / ".dockerignore"]:
        text = path.read_text(encoding="utf-8", errors="replace")
        for what, pattern in SECRET_VALUES:
            m = pattern.search(text)
            assert m is None, f"{path.relative_to(ROOT)} holds what looks like {what}: {m.group()[:12]}..."
    # Where credentials have a slot, the slot holds an empty value or a placeholder, nothing else.
    slots = {
        "hangdx.env.example": dotenv(ENV_EXAMPLE),
        "k8s/settings.env": dotenv(K8S / "settings.env"),
        "k8s/secret.example.yaml": secret_example()["stringData"],
    }
    for where, values in slots.items():
        for key, value in values.items():
            if key in CREDENTIALS or key == "ssh-privatekey":
                assert PLACEHOLDER.match(value.strip()), (
                    f"{where}: {key} must be a placeholder, not {value!r}"
                )
    assert not CREDENTIALS & set(dotenv(K8S / "settings.env")), (
        "credentials belong in the Secret, not a ConfigMap"
    )


def test_every_variable_named_in_deploy_is_a_documented_hangdx_setting() -> None:
    documented = readme_settings()
    assert {"SLACK_BOT_TOKEN", "REDIS_URL", "HANGDX_RESOLVER", "HANGDX_ALERT_TOKEN"} <= documented
    for path in deploy_files(ours_only=True):
        for name in set(
            re.findall(r"\b(?:SLACK|HANGDX|REDIS)_[A-Z0-9_]+\b", path.read_text(encoding="utf-8"))
        ):
            assert name in documented, (
                f"{path.relative_to(ROOT)} names {name}, which README.md does not document"
            )
    example = dotenv(ENV_EXAMPLE)
    assert set(example) <= set(SETTINGS)
    needed = {
        "SLACK_BOT_TOKEN",
        "SLACK_SIGNING_SECRET",
        "REDIS_URL",
        "HANGDX_ALERT_CHANNEL",
        "HANGDX_ALERT_TOKEN",
    }
    assert needed | {"HANGDX_RESOLVER"} <= set(example)


@pytest.mark.parametrize("where", ["compose and systemd", "kubernetes"])
def test_example_settings_start_the_bot_once_filled_in_and_refuse_to_until_then(where: str) -> None:
    if where == "kubernetes":
        env = {**dotenv(K8S / "settings.env"), **secret_example()["stringData"]}
        del env["ssh-privatekey"]
    else:
        env = dotenv(ENV_EXAMPLE)
    with pytest.raises(ConfigError, match="SLACK_BOT_TOKEN"):
        BotConfig.from_env(env)  # the placeholders stop `hangdx serve` with one line naming the variable
    cfg = BotConfig.from_env(filled(env))
    cfg.require_slack()
    assert (cfg.bot_token, cfg.alert_channel, cfg.alert_token) == (
        FILLED["SLACK_BOT_TOKEN"],
        FILLED["HANGDX_ALERT_CHANNEL"],
        FILLED["HANGDX_ALERT_TOKEN"],
    )
    assert cfg.resolver == "inventory:/etc/hangdx/inventory.yaml"


# -- compose ------------------------------------------------------------------------------------------------


def test_compose_runs_redis_with_a_persistent_volume_and_a_healthcheck() -> None:
    c = compose()
    assert {"redis", "bot", "worker"} <= set(c["services"])
    r = c["services"]["redis"]
    assert re.fullmatch(r"redis:\d+\.\d+\.\d+(-[a-z0-9]+)?", r["image"]), f"pin Redis's version: {r['image']}"
    cmd = r["command"]
    assert cmd[0] == "redis-server" and cmd[cmd.index("--appendonly") + 1] == "yes"
    (volume,) = r["volumes"]
    name, target = volume.split(":")[:2]
    assert target == "/data", "the official image keeps its files in /data"
    assert name in (c.get("volumes") or {}), f"{name} must be a named volume to outlive the container"
    assert "redis-cli" in r["healthcheck"]["test"] and "ping" in r["healthcheck"]["test"]
    assert r.get("restart") in ("always", "unless-stopped")


def test_compose_bot_and_worker_run_real_hangdx_commands() -> None:
    c = compose()
    entrypoint = exec_form([rest for instr, rest in runtime() if instr == "ENTRYPOINT"][-1])
    assert entrypoint == ["hangdx"]
    bot = parse_cli(c["services"]["bot"]["command"])
    assert (bot.command, bot.host) == ("serve", "0.0.0.0")
    published = {int(p.rsplit(":", 1)[1]) for p in c["services"]["bot"]["ports"]}
    assert published == {bot.port}, "the published port is the one `serve` listens on"
    assert parse_cli(c["services"]["worker"]["command"]).command == "worker"
    image_cmd = parse_cli(exec_form([rest for instr, rest in runtime() if instr == "CMD"][-1]))
    assert (image_cmd.command, image_cmd.host, image_cmd.port) == ("serve", "0.0.0.0", 3000)
    assert f"127.0.0.1:{image_cmd.port}/healthz" in healthcheck()[-1], (
        "HEALTHCHECK asks the port serve listens on"
    )


def test_compose_gives_bot_and_worker_redis_and_their_credentials() -> None:
    c = compose()
    services = c["services"]
    example = dotenv(ENV_EXAMPLE)
    needs = {
        "bot": {"SLACK_BOT_TOKEN", "SLACK_SIGNING_SECRET", "HANGDX_ALERT_TOKEN", "HANGDX_ALERT_CHANNEL"},
        "worker": {"SLACK_BOT_TOKEN", "HANGDX_RESOLVER"},
    }
    for name, needed in needs.items():
        s = services[name]
        env_files = s["env_file"] if isinstance(s["env_file"], list) else [s["env_file"]]
        assert env_files == ["hangdx.env"], "the file `cp hangdx.env.example hangdx.env` makes"
        assert needed <= set(example), f"{name} needs {sorted(needed - set(example))}"
        url = urlparse(s["environment"]["REDIS_URL"])
        assert (url.scheme, url.hostname, url.port or 6379) == ("redis", "redis", 6379)
        assert url.hostname in services
        assert s["depends_on"]["redis"]["condition"] == "service_healthy"
        assert s["restart"] in ("always", "unless-stopped")
        assert s.get("read_only") is True and "/tmp" in s.get("tmpfs", [])
    worker, bot = services["worker"], services["bot"]
    assert worker["deploy"]["replicas"] == 2
    # `--scale worker=N` needs no fixed name and no published port.
    assert "container_name" not in worker and "ports" not in worker
    # The image's HEALTHCHECK asks /healthz, which only `serve` answers.
    assert worker["healthcheck"] == {"disable": True}
    mounts = {m["target"]: m for m in worker["volumes"]}
    ssh = mounts[f"{image_home()}/.ssh"]
    assert ssh["type"] == "bind" and ssh["read_only"] is True
    inventory = Path(example["HANGDX_RESOLVER"].split(":", 1)[1])
    assert mounts[str(inventory.parent)]["read_only"] is True, (
        "the inventory's folder is mounted in the worker"
    )
    assert not [v for v in bot.get("volumes", []) if ".ssh" in str(v)], "the bot never needs the SSH key"


def _redis_args() -> dict[str, list[str]]:
    (sts,) = by_kind(kustomize()[0], "StatefulSet").values()
    (container,) = pod(sts)["containers"]
    return {"compose": compose()["services"]["redis"]["command"], "kubernetes": container["args"]}


@pytest.mark.parametrize("where", ["compose", "kubernetes"])
def test_redis_as_deployed_keeps_its_data_across_a_restart(where: str, tmp_path: Path) -> None:
    args = _redis_args()[where]
    with redis_server(args, tmp_path / "data") as url:
        client = redis.Redis.from_url(url)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        client.set("hangdx:incident:12345", "kept")
        client.shutdown(nosave=True)  # no snapshot: only the append-only file can bring the key back
    with redis_server(args, tmp_path / "data") as url:
        assert redis.Redis.from_url(url).get("hangdx:incident:12345") == b"kept"


def test_compose_commands_and_the_image_healthcheck_run_a_real_bot_and_worker(tmp_path: Path) -> None:
    """redis, bot and worker as compose.yaml runs them (host and ports moved to free loopback ones), with the
    filled-in example settings; the HEALTHCHECK command from the Dockerfile judges the bot."""
    c = compose()
    port = free_port()
    bot_cmd = [
        str(port) if a == "3000" else "127.0.0.1" if a == "0.0.0.0" else a
        for a in c["services"]["bot"]["command"]
    ]
    probe = healthcheck()
    assert probe[0] == "python" and ":3000/healthz" in probe[-1]
    probe = [sys.executable, *probe[1:-1], probe[-1].replace(":3000/", f":{port}/")]
    with redis_server(c["services"]["redis"]["command"], tmp_path / "redis") as url, SlackStandin() as slack:
        env = {k: v for k, v in os.environ.items() if k not in SETTINGS and k != "HANGDX_CONFIG"}
        env.update(filled(dotenv(ENV_EXAMPLE)), REDIS_URL=url, SLACK_API_URL=slack.url)
        log = (tmp_path / "hangdx.log").open("wb")
        procs = [
            subprocess.Popen([sys.executable, "-m", "hangdx", *cmd], env=env, stdout=log, stderr=log)
            for cmd in (bot_cmd, c["services"]["worker"]["command"])
        ]
        try:
            bot, worker = procs

            def healthy() -> bool:
                assert bot.poll() is None, (tmp_path / "hangdx.log").read_text()
                return subprocess.run(probe, capture_output=True, timeout=15).returncode == 0

            wait_for("the HEALTHCHECK to pass", healthy)
            from rq import Worker

            workers = wait_for(
                "the worker in Redis", lambda: Worker.all(connection=redis.Redis.from_url(url))
            )
            assert [w.queue_names() for w in workers] == [["hangdx", "hangdx-analyze"]]  # diagnoses first
            assert stop(bot) == 0, "serve stops cleanly on SIGTERM, even as PID 1 in a pod"
            assert subprocess.run(probe, capture_output=True, timeout=15).returncode != 0, (
                "a dead bot is unhealthy"
            )
            assert stop(worker) == 0, "a worker stops cleanly on SIGTERM (docker stop, kubectl, systemctl)"
        finally:
            for p in procs:
                if p.poll() is None:
                    stop(p, signal.SIGKILL)
            log.close()


# -- the image ----------------------------------------------------------------------------------------------


def test_dockerfile_builds_a_wheel_and_installs_hashed_pins_as_a_fixed_non_root_user() -> None:
    st = stages()
    assert len(st) >= 2, "multi-stage: the wheel is built apart from the runtime image"
    for stage in st:
        base = stage[0][1].split()[0]
        assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", base), f"pin the base image: {base}"
    build_name = st[0][0][1].split()[-1]
    run = " ".join(rest for instr, rest in runtime() if instr == "RUN")
    copies = [rest for instr, rest in runtime() if instr == "COPY"]
    assert any(c.startswith(f"--from={build_name} ") and ".whl" not in c and "/wheels" in c for c in copies)
    (lock_copy,) = [c for c in copies if c.startswith("deploy/requirements.lock ")]
    lock_in_image = lock_copy.split()[-1]
    lock_install = re.search(r"pip install ([^&]*-r " + re.escape(lock_in_image) + r"[^&]*)", run)
    assert lock_install, "runtime dependencies come from deploy/requirements.lock"
    assert {"--require-hashes", "--no-deps"} <= set(lock_install.group(1).split())
    assert re.search(r"pip install --no-deps /tmp/wheels/hangdx-\*\.whl", run)
    uid, gid = image_user()
    assert uid != 0 and gid != 0
    assert re.search(rf"useradd [^&]*--uid {uid} ", run) and re.search(rf"groupadd [^&]*--gid {gid} ", run)
    assert re.search(rf"--home-dir {re.escape(image_home())} ", run)
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert "torch" not in re.sub(r"#.*", "", text), "no torch in the image"
    assert not [i for i, _ in dockerfile() if i == "ADD"], "COPY only: ADD fetches URLs and unpacks archives"
    for instr, rest in dockerfile():
        if instr == "COPY" and not rest.startswith("--from="):
            for src in rest.split()[:-1]:
                assert not re.search(r"ssh|known_hosts|\.env$|id_", src), f"never bake secrets in: COPY {src}"
                assert (ROOT / src).exists(), f"COPY {src}: no such file in the build context"
                files = [ROOT / src] if (ROOT / src).is_file() else sorted((ROOT / src).rglob("*.*"))
                for f in files:
                    if "__pycache__" not in f.parts:
                        rel = f.relative_to(ROOT).as_posix()
                        assert not dockerignore_excludes(rel), f".dockerignore leaves {rel} out of the build"


def test_dockerignore_keeps_secrets_and_clutter_out_of_the_build_context() -> None:
    for rel in (
        "deploy/hangdx.env",
        "deploy/ssh/id_ed25519",
        "deploy/ssh/known_hosts",
        "deploy/config/inventory.yaml",
        "deploy/k8s/secret.example.yaml",
        ".git/config",
        "tests/bot/test_incidents.py",
        "bot/__pycache__/cli.cpython-311.pyc",
        "hangdx.egg-info/PKG-INFO",
    ):
        assert dockerignore_excludes(rel), f"{rel} would be sent to the Docker daemon"
    for rel in ("pyproject.toml", "README.md", "bot/cli.py", "playbooks/templates/straggler.j2"):
        assert not dockerignore_excludes(rel), rel


def test_serve_and_worker_never_import_torch() -> None:
    """What the image runs (everything but the demo and the zoo) imports without torch, which it lacks."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import hangdx.bot, hangdx.probes, hangdx.playbooks\n"
        "for pkg in (hangdx.bot, hangdx.probes, hangdx.playbooks):\n"
        "    for m in pkgutil.iter_modules(pkg.__path__):\n"
        "        if f'{pkg.__name__}.{m.name}' != 'hangdx.bot.demo':\n"
        "            importlib.import_module(f'{pkg.__name__}.{m.name}')\n"
        "import hangdx.cli, slack_bolt.adapter.socket_mode\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert "torch" not in LOCK.read_text() and "nvidia" not in LOCK.read_text()


def test_requirements_lock_pins_every_runtime_dependency_with_hashes() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+, like the image
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    text = LOCK.read_text(encoding="utf-8")
    assert "by the following command" in text and "--generate-hashes" in text
    entries = re.split(r"\n(?=[A-Za-z0-9])", re.sub(r"(?m)^\s*#.*\n?", "", text).strip())
    pins: dict[str, Version] = {}
    for entry in entries:
        head = entry.split("\\")[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", head)
        assert m, f"not an exact pin: {head!r}"
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", entry)
        assert hashes, f"{head} has no hash (pip install --require-hashes would refuse the whole file)"
        pins[canonicalize_name(m.group(1))] = Version(m.group(2))
    for dep in pyproject["project"]["dependencies"]:
        req = Requirement(dep)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) is not in deploy/requirements.lock"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} is not {req.specifier}"
        )
    assert "py-spy" in pins
    assert not {n for n in pins if n.startswith(("torch", "nvidia"))}
    # Closed under dependencies, on the image's Python and on Debian 12's 3.11.2 (systemd), for every pinned
    # package whose pinned version is installed here (its metadata says what it needs).
    checked = 0
    for name, version in pins.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if Version(dist.version) != version:
            continue
        checked += 1
        for req in map(Requirement, dist.requires or []):
            for python in ("3.11.2", "3.11.14"):
                env = {"python_full_version": python, "python_version": "3.11", "extra": ""}
                if req.marker is None or req.marker.evaluate(env):
                    assert canonicalize_name(req.name) in pins, f"{name} needs {req} on Python {python}"
    assert checked, "no pinned version is installed here to read its requirements from"


# -- Kubernetes ---------------------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest_and_no_example() -> None:
    _, listed = kustomize()
    present = {p for p in K8S.rglob("*") if p.is_file()}
    examples = {p for p in present if p.name.endswith(".example.yaml")}
    assert K8S / "secret.example.yaml" in examples
    assert not listed - present, f"listed but missing: {sorted(str(p) for p in listed - present)}"
    assert not listed & examples, "an example Secret must never be applied over the real one"
    assert present - examples == listed, (
        f"never applied: {sorted(str(p) for p in present - examples - listed)}"
    )


def test_k8s_every_secret_configmap_and_volume_a_pod_names_exists() -> None:
    assert reference_problems(kustomize()[0], secret_example()) == []


def test_k8s_reference_check_catches_a_dangling_key() -> None:
    objects = kustomize()[0]
    broken = copy.deepcopy(objects)
    bot = workloads(broken)["hangdx-bot"]
    bot["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]["key"] = (
        "SLACK_TOKEN"
    )
    worker = workloads(broken)["hangdx-worker"]
    worker["spec"]["template"]["spec"]["containers"][0]["volumeMounts"].append(
        {"name": "keys", "mountPath": "/k"}
    )
    problems = reference_problems(broken, secret_example())
    assert any("no key 'SLACK_TOKEN'" in p for p in problems) and any("'keys'" in p for p in problems)


def test_k8s_pods_run_non_root_read_only_without_capabilities_with_limits() -> None:
    uid, gid = image_user()
    objects = kustomize()[0]
    for name, w in workloads(objects).items():
        spec = pod(w)
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec.get("automountServiceAccountToken") is False, f"{name} never talks to the Kubernetes API"
        for c in spec["containers"]:
            sc = {**spec["securityContext"], **c.get("securityContext", {})}
            where = f"{name}/{c['name']}"
            assert sc.get("runAsUser", 0) != 0 and sc["runAsNonRoot"] is True, where
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{where}: {kind}"
            if c["image"].split(":")[0] == "hangdx":
                assert (sc["runAsUser"], sc["runAsGroup"]) == (uid, gid), (
                    f"{where}: the image's user is {uid}:{gid}"
                )
                tmp = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}["/tmp"]
                assert "emptyDir" in {v["name"]: v for v in spec["volumes"]}[tmp], (
                    f"{where}: /tmp is an emptyDir"
                )
    worker = pod(workloads(objects)["hangdx-worker"])
    (container,) = worker["containers"]
    mount = {m["mountPath"]: m for m in container["volumeMounts"]}[f"{image_home()}/.ssh"]
    assert mount["readOnly"] is True
    ssh = {v["name"]: v for v in worker["volumes"]}[mount["name"]]["projected"]
    (key,) = [i for s in ssh["sources"] if "secret" in s for i in s["secret"]["items"]]
    assert key["path"] == "id_ed25519" and key["mode"] == 0o400 and ssh["defaultMode"] == 0o400
    (known,) = [i for s in ssh["sources"] if "configMap" in s for i in s["configMap"]["items"]]
    assert known["path"] == "known_hosts"
    assert worker["securityContext"]["fsGroup"] == gid, (
        "with mode 0400 (root's), only fsGroup lets uid read the key"
    )


def test_k8s_probes_services_and_network_policy_line_up() -> None:
    objects = kustomize()[0]
    w = workloads(objects)
    (bot,) = pod(w["hangdx-bot"])["containers"]
    args = parse_cli(bot["args"])
    assert (args.command, args.host) == ("serve", "0.0.0.0")
    for probe in ("readinessProbe", "livenessProbe"):
        get = bot[probe]["httpGet"]
        assert get["path"] == "/healthz" and container_port(bot, get["port"]) == args.port, probe
    (worker,) = pod(w["hangdx-worker"])["containers"]
    assert parse_cli(worker["args"]).command == "worker"
    assert w["hangdx-worker"]["spec"]["replicas"] == 2
    services = by_kind(objects, "Service")
    for svc in services.values():
        backends = [
            x
            for x in w.values()
            if selects(svc["spec"]["selector"], x["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(backends) == 1, f"Service {svc['metadata']['name']} selects {len(backends)} workloads"
        (c,) = pod(backends[0])["containers"]
        for p in svc["spec"]["ports"]:
            container_port(c, p["targetPort"])
    snippets = re.findall(r"```yaml\n(.*?)```", (DEPLOY / "README.md").read_text(encoding="utf-8"), re.S)
    (ingress,) = [d for d in map(yaml.safe_load, snippets) if d.get("kind") == "Ingress"]
    (path,) = [p for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    assert path["path"] == "/slack/events", "the guide's Ingress exposes Slack's endpoint, not /alerts"
    backend = path["backend"]["service"]
    assert backend["port"]["number"] in {p["port"] for p in services[backend["name"]]["spec"]["ports"]}
    settings = by_kind(objects, "ConfigMap")["hangdx-settings"]["data"]
    url = urlparse(settings["REDIS_URL"])
    assert url.hostname in services and url.port in {
        p["port"] for p in services[url.hostname]["spec"]["ports"]
    }
    (policy,) = by_kind(objects, "NetworkPolicy").values()
    redis_labels = w["redis"]["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], redis_labels)
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    for name in ("hangdx-bot", "hangdx-worker"):
        assert selects(
            peer["podSelector"]["matchLabels"], w[name]["spec"]["template"]["metadata"]["labels"]
        ), name
    assert not selects(peer["podSelector"]["matchLabels"], redis_labels)
    assert [p["port"] for p in rule["ports"]] == [url.port]
    sts = w["redis"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    (redis_c,) = pod(sts)["containers"]
    assert {m["name"]: m["mountPath"] for m in redis_c["volumeMounts"]} == {
        claim["metadata"]["name"]: "/data"
    }
    assert redis_c["image"] == compose()["services"]["redis"]["image"], "one Redis version everywhere"


def test_inventory_example_is_read_by_hangdx_and_leaves_the_ssh_files_to_the_mounts() -> None:
    from hangdx.probes import resolve

    hosts, settings = resolve.resolve_with_settings("train-example", f"inventory:{K8S / 'inventory.yaml'}")
    assert [h.name for h in hosts] == [f"gpu-node-{i:02d}" for i in range(1, 5)]
    assert not {"key_file", "known_hosts"} & set(settings), "the key and known_hosts come from ~/.ssh mounts"


def test_kubectl_kustomize_renders_the_same_objects_with_consistent_names() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    kinds = sorted((o["kind"], re.sub(r"-[a-z0-9]{10}$", "", o["metadata"]["name"])) for o in rendered)
    assert kinds == sorted((o["kind"], o["metadata"]["name"]) for o in kustomize()[0])
    assert {o["metadata"].get("namespace") for o in rendered if o["kind"] != "Namespace"} == {"hangdx"}
    # Generated ConfigMaps get a hash suffix: every reference must have followed it.
    assert reference_problems(rendered, secret_example()) == []
    for w in workloads(rendered).values():
        for c in pod(w)["containers"]:
            assert re.fullmatch(r"[\w./-]+:\d[\w.-]*", c["image"]), f"pinned image tag: {c['image']}"


def test_k8s_manifests_match_the_kubernetes_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    version = "1.29.0"  # the oldest Kubernetes these manifests are for
    objects = [o for o in kustomize()[0]] + [secret_example()]
    for obj in objects:
        kv.validate(obj, version, strict=True)
    snippets = re.findall(r"```yaml\n(.*?)```", (DEPLOY / "README.md").read_text(encoding="utf-8"), re.S)
    manifests = [d for d in map(yaml.safe_load, snippets) if "kind" in d]  # all parse; the Ingress is one
    assert [d["kind"] for d in manifests] == ["Ingress"]
    kv.validate(manifests[0], version, strict=True)
    typo = copy.deepcopy(workloads(objects)["hangdx-bot"])
    typo["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(typo, version, strict=True)


# -- systemd ------------------------------------------------------------------------------------------------


def unit(path: Path) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


UNITS = {"hangdx-serve.service": "serve", "hangdx-worker@.service": "worker"}


def test_systemd_units_run_hangdx_as_its_user_hardened_after_redis() -> None:
    assert {p.name for p in SYSTEMD.glob("*.service")} == set(UNITS)
    for name, command in UNITS.items():
        u = unit(SYSTEMD / name)
        s = u["Service"]
        argv = shlex.split(s["ExecStart"][-1])
        assert argv[0] == "/usr/local/bin/hangdx"
        args = parse_cli(argv[1:])
        assert args.command == command
        if command == "serve":
            assert (args.host, args.port) == ("0.0.0.0", 3000)
        assert s["User"] == ["hangdx"] and s["Restart"] == ["always"]
        assert s["EnvironmentFile"] == ["/etc/hangdx/hangdx.env"]
        for key, value in {
            "NoNewPrivileges": "yes",
            "ProtectSystem": "strict",
            "ProtectHome": "yes",
            "PrivateTmp": "yes",
            "PrivateDevices": "yes",
            "CapabilityBoundingSet": "",
        }.items():
            assert s.get(key) == [value], f"{name}: {key}={value}"
        for key in ("After", "Wants"):
            assert "redis-server.service" in " ".join(u["Unit"][key]).split(), f"{name}: {key}"
        assert u["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify wants ExecStart's program to exist: point it at this checkout's hangdx, in copies.
    here = f"{sys.executable} -m hangdx"
    for name in UNITS:
        (tmp_path / name).write_text((SYSTEMD / name).read_text().replace("/usr/local/bin/hangdx", here))
    for name in ("hangdx-serve.service", "hangdx-worker@1.service"):
        out = subprocess.run(
            [analyze, "verify", str(tmp_path / name)], capture_output=True, text=True, timeout=60
        )
        stem = name.split("@")[0]
        complaints = [line for line in (out.stdout + out.stderr).splitlines() if stem in line]
        assert out.returncode == 0 and not complaints, f"{name}: {out.stderr}"


def test_systemd_verify_catches_a_misspelt_key(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    text = (
        (SYSTEMD / "hangdx-serve.service")
        .read_text()
        .replace("/usr/local/bin/hangdx", f"{sys.executable} -m hangdx")
    )
    (tmp_path / "hangdx-serve.service").write_text(text.replace("ProtectSystem=", "ProtectSytem="))
    out = subprocess.run(
        [analyze, "verify", str(tmp_path / "hangdx-serve.service")], capture_output=True, text=True
    )
    assert "ProtectSytem" in out.stderr


# -- the guide ----------------------------------------------------------------------------------------------


def test_deploy_readme_names_only_files_that_exist_or_that_the_steps_create() -> None:
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    for section in ("Docker Compose", "Kubernetes", "systemd"):
        assert f"## {section}" in text
    paths = set(re.findall(r"\bdeploy/[\w./@{}-]*[\w}]", text))
    assert "deploy/slack-app-manifest.yaml" in paths
    for p in sorted(paths):
        path = ROOT / p
        assert path.exists() or _gitignored(path), f"deploy/README.md names {p}, which does not exist"


def test_deploy_readme_hangdx_commands_are_valid_command_lines() -> None:
    (sub,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    found = []
    for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, re.S):
        # `hangdx CMD ...`, and `compose run worker CMD ...` (the image's entrypoint is hangdx)
        for m in re.finditer(r"(?<![\w.-])(?:hangdx|run --rm worker) (?=[a-z])", block):
            argv = shlex.split(re.split(r"[#|&;)\n]", block[m.end() :], maxsplit=1)[0])
            if argv[0] in sub.choices:
                found.append(parse_cli(argv).command)
    assert found.count("doctor") == 3, "the guide checks the nodes from where the workers run, every way"
