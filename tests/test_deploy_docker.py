"""The Docker deployment, checked without a Docker engine (there is none here): the Dockerfile
and compose file parse, run our commands with options those commands have, set only real config
keys, keep keys and checkpoints in volumes, run as non-root, stop with SIGINT, and agree with
the `docker ...` commands the READMEs show. `docker compose config` validates the compose file
where a Compose binary is installed; the slow tier joins a backbone by a `/dns4/` address, as
the compose peers do, in a private network namespace (root only)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from typer.testing import CliRunner

from cli.backbone_cli import app as backbone_app
from cli.peer_cli import app as peer_app
from peer.config import load_config
from peer.daemon import parse_backbones
from peer.net.identity import load_or_create_identity

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
COMPOSE = ROOT / "deploy" / "compose.yaml"
DOCKERIGNORE = ROOT / ".dockerignore"
READMES = [ROOT / "README.md", ROOT / "deploy" / "README.md"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
APPS = {"backbone": backbone_app, "peer": peer_app}
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"


# ------------------------------------------------------------------ Dockerfile


@dataclass(frozen=True)
class Instruction:
    keyword: str
    """Upper-cased, e.g. RUN."""
    args: str
    """The rest of the logical line, continuation lines joined."""
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Logical instructions: comments and blank lines dropped (inside continuations too, as
    Docker does), lines ending in a backslash joined to the next."""
    assert "# escape=" not in text, "an escape directive would change continuations"
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        keyword, _, args = " ".join([*pending, line]).partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
        pending = []
    assert not pending, "the Dockerfile ends inside a continuation line"
    return out


def exec_form(instruction: Instruction) -> list[str] | None:
    """The JSON array of an exec-form CMD/ENTRYPOINT/RUN, None for the shell form."""
    if not instruction.args.startswith("["):
        return None
    # Docker would silently run malformed JSON as a shell command; here it fails.
    value = json.loads(instruction.args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), instruction
    return value


def key_values(instruction: Instruction) -> dict[str, str]:
    """ENV/ARG/LABEL pairs: `K=V K2="V 2"`, or the legacy `ENV K V`; an ARG may have no value."""
    words = shlex.split(instruction.args)
    if instruction.keyword == "ENV" and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) if "=" in w else (w, "") for w in words)


def substitute(text: str, variables: Mapping[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m[1] or m[2]], text)


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    """Instructions split at each FROM (each stage starts with its FROM)."""
    out: list[list[Instruction]] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def global_args(instructions: list[Instruction]) -> dict[str, str]:
    """ARGs declared before the first FROM: what FROM lines may use."""
    args: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "FROM":
            break
        if ins.keyword == "ARG":
            args.update(key_values(ins))
    return args


def of_kind(stage: list[Instruction], keyword: str) -> list[Instruction]:
    """The stage's instructions with this keyword, in order."""
    return [ins for ins in stage if ins.keyword == keyword]


def stage_env(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in of_kind(stage, "ENV"):
        env.update(key_values(ins))
    return env


INSTRUCTIONS = parse_dockerfile(DOCKERFILE.read_text())
STAGES = stages(INSTRUCTIONS)
FINAL = STAGES[-1]
IMAGE_ENV = stage_env(FINAL)
(STATE_DIR,) = (v for ins in of_kind(FINAL, "VOLUME") for v in shlex.split(ins.args))
(EXPOSED,) = (int(p.split("/")[0]) for ins in of_kind(FINAL, "EXPOSE") for p in ins.args.split())


def test_dockerfile_parses_into_known_instructions():
    known = {"FROM", "ARG", "ENV", "RUN", "COPY", "LABEL", "VOLUME", "WORKDIR", "USER"}
    known |= {"EXPOSE", "STOPSIGNAL", "CMD", "ENTRYPOINT", "HEALTHCHECK", "SHELL"}
    assert {ins.keyword for ins in INSTRUCTIONS} <= known
    assert len(STAGES) == 2, "a build stage and a runtime stage"
    assert parse_dockerfile('# c\nRUN a \\\n  # dropped\n  && b\nCMD ["x"]\n') == [
        Instruction("RUN", "a && b", 2),
        Instruction("CMD", '["x"]', 5),
    ]


def test_base_image_is_pinned_python_311_by_version_and_digest():
    variables = global_args(INSTRUCTIONS)
    images = [substitute(stage[0].args.split()[0], variables) for stage in STAGES]
    assert len(set(images)) == 1, "the venv is built and run on the same Python"
    pinned = re.fullmatch(r"python:(3\.11\.\d+)-slim-\w+@sha256:[0-9a-f]{64}", images[0])
    assert pinned, images[0]
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(pinned[1])


def test_image_installs_cpu_torch_at_a_version_pyproject_admits():
    (requirement,) = (d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    admitted = SpecifierSet(requirement.removeprefix("torch"))
    build = STAGES[0]
    assert key_values(of_kind(build, "ARG")[0]) == {"TORCH_INDEX_URL": CPU_TORCH_INDEX}
    runs = [ins.args for ins in of_kind(build, "RUN")]
    (torch_run,) = (r for r in runs if "torch==" in r)
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_run
    name, version = shlex.split(torch_run)[-1].split("==")
    # Exact, and admitted also as the CPU index's local build (2.13.0+cpu).
    assert name == "torch" and admitted.contains(version) and admitted.contains(version + "+cpu")
    # The project install comes after, so the pin is already satisfied and torch stays CPU.
    assert runs.index(torch_run) < next(i for i, r in enumerate(runs) if r.endswith("/src"))


def test_image_runs_our_cli_as_non_root_and_stops_with_sigint():
    (user,) = of_kind(FINAL, "USER")
    uid = user.args.split(":")[0]
    assert uid not in ("root", "0")
    assert any(f"--uid {uid}" in ins.args for ins in of_kind(FINAL, "RUN"))
    assert [ins.args for ins in of_kind(FINAL, "STOPSIGNAL")] == ["SIGINT"]
    # No ENTRYPOINT: `docker run IMAGE backbone start ...` runs the console script itself.
    assert not of_kind(FINAL, "ENTRYPOINT")
    (cmd,) = of_kind(FINAL, "CMD")
    argv = exec_form(cmd)  # exec form: the CLI is PID 1 and receives the stop signal
    assert argv is not None and argv[0] in PYPROJECT["project"]["scripts"]
    # The console scripts live in the venv built in the first stage and copied as a whole.
    (venv_run,) = (ins for ins in of_kind(STAGES[0], "RUN") if " -m venv " in ins.args)
    venv = venv_run.args.split()[-1]
    assert any(ins.args == f"--from=build {venv} {venv}" for ins in of_kind(FINAL, "COPY"))
    assert IMAGE_ENV["PATH"].split(":")[0] == f"{venv}/bin"
    assert set(APPS) == set(PYPROJECT["project"]["scripts"])


def test_image_keeps_key_and_checkpoints_in_its_state_volume():
    env = {k: v for k, v in IMAGE_ENV.items() if k.startswith("PEERTRAIN_")}
    loaded = load_config(env=env)  # a wrong key or value raises ConfigError
    assert loaded.sources["identity.path"].startswith("env")
    assert loaded.config.identity.path.startswith(f"{STATE_DIR}/")
    assert loaded.config.training.checkpoint_dir.startswith(f"{STATE_DIR}/")
    # The volume's folder belongs to the user the image runs as, or nothing could be written.
    assert any(f"-o peertrain -g peertrain -m 0700 {STATE_DIR}" in i.args for i in FINAL)


# ------------------------------------------------------------------ .dockerignore


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides, `!`
    re-includes; `*` and `?` stay within one path segment, `**` spans any number."""

    def regex(pattern: str) -> re.Pattern[str]:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] in "*?":
                out, i = out + ("[^/]*" if pattern[i] == "*" else "[^/]"), i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                out, i = out + pattern[i : end + 1], end + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out + r"\Z")

    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        rx = regex(pattern.removeprefix("!").strip("/"))
        if any(rx.match(p) for p in prefixes):
            excluded = not negated
    return excluded


DOCKERIGNORE_PATTERNS = [
    line.strip()
    for line in DOCKERIGNORE.read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


def in_context(path: str) -> bool:
    return not dockerignore_excludes(path, DOCKERIGNORE_PATTERNS)


def test_build_context_holds_what_the_image_copies():
    copied = []
    for ins in of_kind(STAGES[0] + FINAL, "COPY"):
        if ins.args.startswith("--from="):
            continue
        *sources, _destination = shlex.split(ins.args)
        copied += sources
    for source in copied:
        path = ROOT / source
        found = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
        files = [f for f in found if "__pycache__" not in f.parts]
        assert files, source
        for f in files:
            assert in_context(f.relative_to(ROOT).as_posix()), f
    # pip builds the package from these: its packages and its readme.
    packages = {
        p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert packages <= set(copied)
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= set(copied)


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        ".git/HEAD",
        ".pytest_cache/v/x",
        ".ruff_cache/x",
        "peer/__pycache__/config.cpython-311.pyc",
        "peer/config.pyc",
        "tests/test_deploy.py",
        "peertrain.egg-info/PKG-INFO",
        "checkpoints/default/gpt/state.safetensors",
        "backbone.key",
        "configs/backbone.key",
        "configs/backbone.key.lock",
    ],
)
def test_build_context_leaves_out_environments_caches_checkpoints_and_keys(path):
    assert not in_context(path)


def test_dockerignore_matcher_follows_dockers_rules():
    assert dockerignore_excludes("a/b/c.pyc", ["**/*.pyc"])
    assert not dockerignore_excludes("a/b", ["*", "!a"])
    assert dockerignore_excludes("a/__pycache__/x", ["*", "!a", "**/__pycache__"])
    assert not dockerignore_excludes("ab/x", ["a"])


# ------------------------------------------------------------------ compose


def interpolate(value: Any, host_env: Mapping[str, str]) -> Any:
    """Compose's variable syntax, in every string of the parsed file (as Compose does it):
    ${VAR:-default} and ${VAR} from the host's environment, $$ for a literal $."""
    if isinstance(value, dict):
        return {k: interpolate(v, host_env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, host_env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        return "$" if m[0] == "$$" else host_env.get(m[1]) or (m[3] or "")

    return re.sub(r"\$\$|\$\{(\w+)(:?-([^}]*))?\}", one, value)


def load_compose(host_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), host_env or {})


SERVICES: dict[str, Any] = load_compose()["services"]


def argv_of(service: dict[str, Any]) -> list[str]:
    """What the container runs: entrypoint + command (the image has no ENTRYPOINT)."""

    def words(value: Any) -> list[str]:
        return shlex.split(value) if isinstance(value, str) else list(value or [])

    return words(service.get("entrypoint")) + words(service.get("command"))


def cli_calls(argv: list[str]) -> list[list[str]]:
    """Our CLI invocations in argv: itself, or the `&&`-joined commands of an `sh -c` script
    (`exec` dropped, a `> file` redirection cut off; other programs such as mv skipped)."""
    if argv[:2] != ["sh", "-c"]:
        return [argv]
    calls = []
    for part in argv[2].split("&&"):
        words = shlex.split(part)
        words = words[1:] if words[0] == "exec" else words
        words = words[: words.index(">")] if ">" in words else words
        if words[0] in APPS:
            calls.append(words)
    return calls


def redirect_target(script: str) -> str:
    """The file an `sh -c` script finally writes: `> tmp && mv tmp final` counts as final."""
    parts = [shlex.split(p) for p in script.split("&&")]
    target = next(w[w.index(">") + 1] for w in parts if ">" in w)
    for words in parts:
        if words[:1] == ["mv"] and words[1] == target:
            target = words[2]
    return target


def assert_options_exist(call: list[str]) -> None:
    program, subcommand, *rest = call
    result = CliRunner().invoke(APPS[program], [subcommand, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, (call, result.output)
    for option in (w.split("=")[0] for w in rest if w.startswith("--")):
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", result.output), call


def option(call: list[str], name: str) -> str:
    return call[call.index(name) + 1]


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> volume name (short syntax), `:ro` dropped."""
    return {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}


def test_compose_has_an_init_a_backbone_peers_and_a_status_tool_all_on_our_image():
    assert set(SERVICES) == {"backbone-addr", "backbone", "peer", "status"}
    assert {s["image"] for s in SERVICES.values()} == {"peertrain"}
    (built,) = (s["build"] for s in SERVICES.values() if "build" in s)
    assert (COMPOSE.parent / built["context"]).resolve() == ROOT
    assert ROOT / built["dockerfile"] == DOCKERFILE
    assert SERVICES["status"]["profiles"] == ["tools"], "`up` must not start the status tool"


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_a_compose_service_runs_our_commands_with_options_they_have(name):
    calls = cli_calls(argv_of(SERVICES[name]))
    assert calls, name
    for call in calls:
        assert_options_exist(call)


@pytest.mark.parametrize(
    "host_env",
    [
        {},
        {
            "COLLABORATION": "c4",
            "BACKBONE_ANNOUNCE": "/ip4/203.0.113.5/tcp/31337,/dns4/backbone/tcp/31337",
        },
    ],
)
@pytest.mark.parametrize("name", sorted(SERVICES))
def test_a_compose_service_sets_only_real_config_keys(name, host_env):
    env = {**IMAGE_ENV, **env_of(load_compose(host_env)["services"][name])}
    loaded = load_config(env={k: v for k, v in env.items() if k.startswith("PEERTRAIN_")})
    assert loaded.config.collaboration.name == host_env.get("COLLABORATION", "default")
    if name == "backbone":  # unset: announce what the container's interfaces are
        assert len(loaded.config.net.announce) == (2 if host_env else 0)


def test_peers_read_the_address_the_init_service_derives_from_the_backbones_key():
    init, backbone = SERVICES["backbone-addr"], SERVICES["backbone"]
    (start,) = cli_calls(argv_of(backbone))
    (id_call,) = cli_calls(argv_of(init))
    assert start[:2] == ["backbone", "start"] and id_call[:2] == ["backbone", "id"]
    # The address: /dns4/<the backbone service>/tcp/<the port it listens on and the image exposes>.
    host, port = re.fullmatch(r"/dns4/([\w-]+)/tcp/(\d+)", option(id_call, "--address")).groups()
    assert host == "backbone" and int(port) == int(option(start, "--port")) == EXPOSED
    # Same key: both mount one volume where PEERTRAIN_IDENTITY_PATH points; neither overrides it.
    assert mounts(init)[STATE_DIR] == mounts(backbone)[STATE_DIR]
    assert "--identity" not in id_call + start and "PEERTRAIN_IDENTITY_PATH" not in env_of(init)
    # Peers (and the status tool) read the file the init service writes, from a volume that holds
    # only that file, never the backbone's key.
    written = redirect_target(argv_of(init)[2])
    addr_dir = str(PurePosixPath(written).parent)
    for name in ("peer", "status"):
        (call,) = cli_calls(argv_of(SERVICES[name]))
        assert option(call, "--backbone") == f"$(cat {written})"
        assert mounts(SERVICES[name])[addr_dir] == mounts(init)[addr_dir]
        assert SERVICES[name]["volumes"] == [f"{mounts(init)[addr_dir]}:{addr_dir}:ro"]
    assert mounts(init)[addr_dir] != mounts(backbone)[STATE_DIR]


def test_peers_start_once_the_address_is_written_and_the_backbone_answers():
    backbone, peer = SERVICES["backbone"], SERVICES["peer"]
    assert backbone["depends_on"] == {
        "backbone-addr": {"condition": "service_completed_successfully"}
    }
    assert peer["depends_on"] == {
        "backbone-addr": {"condition": "service_completed_successfully"},
        "backbone": {"condition": "service_healthy"},
    }
    check = backbone["healthcheck"]["test"]
    assert check[0] == "CMD" and f"('127.0.0.1', {EXPOSED})" in check[-1]


def test_each_peer_replica_keeps_its_own_key_and_every_node_stops_cleanly():
    peer = SERVICES["peer"]
    # --scale replicas share named volumes: one at the state folder would be one key for all,
    # and the second daemon on a key is refused. The image's VOLUME gives each its own.
    assert STATE_DIR not in mounts(peer) and "container_name" not in peer
    assert argv_of(peer)[2].startswith("exec "), "peer join must be PID 1 to get SIGINT"
    assert peer["restart"] == "on-failure", "a peer that finished training stays down"
    assert SERVICES["backbone"]["restart"] == "unless-stopped"
    for service in SERVICES.values():
        assert service.get("stop_signal", "SIGINT") == "SIGINT"  # else the image's STOPSIGNAL
        assert "user" not in service, "the image's non-root user"
    assert f"{EXPOSED}:{EXPOSED}" in SERVICES["backbone"]["ports"]


def compose_binary() -> list[str] | None:
    """Compose v2 (the Go one: `config --format json`), as a docker plugin or standalone."""
    candidates = [["docker", "compose"]] if shutil.which("docker") else []
    if found := shutil.which("docker-compose"):
        candidates.append([found])
    for command in candidates:
        probe = subprocess.run([*command, "version"], capture_output=True, text=True, check=False)
        if probe.returncode == 0 and re.search(r"version v[2-9]", probe.stdout):
            return command
    return None


def test_docker_compose_config_accepts_the_file():
    compose = compose_binary()
    if compose is None:
        pytest.skip("no Docker Compose v2 (`docker compose` or docker-compose) on the PATH")
    env = {k: v for k, v in os.environ.items() if k not in ("COLLABORATION", "BACKBONE_ANNOUNCE")}
    result = subprocess.run(
        [*compose, "-f", str(COMPOSE), "--profile", "tools", "config", "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)["services"]
    assert set(resolved) == set(SERVICES)
    # Compose's own reading (its output keeps $$ escaped) is what the tests above checked.
    for name, service in SERVICES.items():
        for key in ("entrypoint", "command", "environment"):
            unescaped = json.loads(json.dumps(resolved[name].get(key)).replace("$$", "$"))
            assert unescaped == service.get(key), (name, key)


# ------------------------------------------------------------------ the READMEs


def docker_commands() -> Iterator[tuple[str, dict[str, str], list[str]]]:
    """(where, host variables, argv) of every `docker ...` line in the READMEs' code blocks and
    the two files' comments (continuation lines joined, `# comments` dropped)."""
    sources = [(p, p.read_text()) for p in READMES]
    sources += [
        (p, "\n".join(line.lstrip("#") for line in p.read_text().splitlines()))
        for p in (DOCKERFILE, COMPOSE)
    ]
    for path, text in sources:
        for line in re.sub(r"\\\n\s*", " ", text).splitlines():
            if not line.startswith(("  ", "\t")) or "docker " not in line:
                continue  # only indented code lines that run docker
            words = shlex.split(line, comments=True)
            host_env = {}
            while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                key, _, value = words.pop(0).partition("=")
                host_env[key] = value
            if words[:1] == ["docker"]:
                yield f"{path.relative_to(ROOT)}: {line.strip()}", host_env, words[1:]


DOCKER_LINES = list(docker_commands())
# `docker` options that take no value; every other option takes one (-p 1:1, -v a:b, --name n).
NO_VALUE = frozenset({"-d", "--detach", "--rm", "--init", "--build"})
# In `docker run`, -i, -t and -it are flags too (in `docker build`, -t takes the tag).
RUN_NO_VALUE = NO_VALUE | {"-i", "-t", "-it"}


def split_docker_options(
    words: list[str], *, no_value: frozenset[str] = NO_VALUE
) -> tuple[dict[str, list[str]], list[str]]:
    """(options -> values, the first word that is not an option and everything after it)."""
    options: dict[str, list[str]] = {}
    i = 0
    while i < len(words) and words[i].startswith("-"):
        name, eq, value = words[i].partition("=")
        if eq or name in no_value:
            options.setdefault(name, []).append(value)
            i += 1
        else:
            options.setdefault(name, []).append(words[i + 1])
            i += 2
    return options, words[i:]


def lines_of(subcommand: str) -> list[tuple[str, dict[str, str], list[str]]]:
    return [(where, env, words[1:]) for where, env, words in DOCKER_LINES if words[0] == subcommand]


def built_tags() -> set[str]:
    return {split_docker_options(w)[0]["-t"][0] for _, _, w in lines_of("build")}


def test_the_readmes_show_how_to_build_run_and_compose():
    for readme in READMES:
        shown = {
            words[0]
            for where, _, words in DOCKER_LINES
            if where.startswith(str(readme.relative_to(ROOT)))
        }
        assert {"build", "run", "compose"} <= shown, readme


def test_docker_build_lines_build_the_dockerfile_from_the_repository_root():
    declared = set(global_args(INSTRUCTIONS)) | {
        k for s in STAGES for ins in of_kind(s, "ARG") for k in key_values(ins)
    }
    for where, _, words in lines_of("build"):
        options, rest = split_docker_options(words)
        assert rest == ["."] and options["-f"] == ["deploy/Dockerfile"], where
        assert options["-t"][0].split(":")[0] == SERVICES["backbone"]["image"], where
        for build_arg in options.get("--build-arg", []):
            assert build_arg.split("=")[0] in declared, where
    assert built_tags() == {"peertrain", "peertrain:cuda"}


def test_docker_run_lines_run_our_cli_in_the_built_image():
    runs = lines_of("run")
    assert {tuple(split_docker_options(w, no_value=RUN_NO_VALUE)[1][1:3]) for _, _, w in runs} >= {
        ("backbone", "start"),
        ("backbone", "id"),
        ("peer", "join"),
        ("peer", "status"),
    }
    for where, _, words in runs:
        options, (image, *call) = split_docker_options(words, no_value=RUN_NO_VALUE)
        assert image in built_tags(), where
        assert_options_exist(call)
        for volume in options.get("-v", []):
            assert volume.split(":")[1] == STATE_DIR, where
        env = dict(e.split("=", 1) for e in options.get("-e", []))
        load_config(env={**IMAGE_ENV, **env})
        for published in options.get("-p", []):
            container_port = int(published.split(":")[-1])
            assert container_port in (
                EXPOSED,
                int(option(call, "--port")),
                int(env.get("PEERTRAIN_AVERAGING_DATA_PORT", -1)),
            ), where


def test_docker_compose_lines_name_the_compose_file_and_its_services():
    compose_text = COMPOSE.read_text()
    lines = lines_of("compose")
    assert lines
    for where, host_env, words in lines:
        options, (action, *rest) = split_docker_options(words)
        assert options["-f"] == ["deploy/compose.yaml"], where
        for variable in host_env:
            assert f"${{{variable}:-" in compose_text, where
        # In `compose logs`, -f is --follow; in `compose down`, -v removes the volumes.
        action_options, targets = split_docker_options(rest, no_value=NO_VALUE | {"-f", "-v"})
        for scaled in action_options.get("--scale", []):
            assert scaled.split("=")[0] in SERVICES, where
        if action in ("run", "logs", "exec"):
            service, *args = targets
            assert service in SERVICES, where
            if args:  # appended to the entrypoint's "$@": options of the service's command
                (call,) = cli_calls(argv_of(SERVICES[service]))
                assert_options_exist([*call[:2], *args])
        else:
            assert action in ("up", "down", "config", "ps", "build") and not targets, where


# ------------------------------------------------------------------ backbone id


def invoke_id(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(backbone_app, ["id", *args], env=env)


def test_backbone_id_creates_the_key_once_and_prints_its_peer_id(tmp_path):
    key = tmp_path / "state" / "backbone.key"
    first_run = invoke_id("--identity", str(key))
    assert first_run.exit_code == 0, first_run.output
    seed = key.read_bytes()
    second_run = invoke_id("--identity", str(key))
    assert second_run.output == first_run.output
    assert key.read_bytes() == seed and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert first_run.output.strip() == str(load_or_create_identity(key).peer_id)


def test_backbone_id_prints_an_address_peer_join_accepts(tmp_path):
    key = tmp_path / "backbone.key"
    result = invoke_id("--identity", str(key), "--address", "/dns4/backbone/tcp/31337")
    assert result.exit_code == 0, result.output
    ((peer_id, transport),) = parse_backbones([result.output.strip()])
    assert peer_id == load_or_create_identity(key).peer_id
    assert str(transport) == "/dns4/backbone/tcp/31337"


def test_backbone_id_uses_the_key_the_environment_names_as_start_does(tmp_path):
    key = tmp_path / "identity.key"
    result = invoke_id(env={"PEERTRAIN_IDENTITY_PATH": str(key)})
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(load_or_create_identity(key).peer_id)


@pytest.mark.parametrize(
    "address",
    [
        "backbone:31337",
        "/ip4/1.2.3.4/tcp/1/p2p/12D3KooWRq4tRRfDE1ZbAnpYPiwCxsQhV2U8uFDtM3qjUfASSFMV",
    ],
)
def test_backbone_id_refuses_a_bad_address_in_one_line(tmp_path, address):
    result = invoke_id("--identity", str(tmp_path / "k"), "--address", address)
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and address in result.output


# ------------------------------------------------------------------ /dns4 end to end

DNS_SERVER = """
import socket, dns.message, dns.rcode, dns.rrset
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("127.0.0.1", 53))
while True:
    data, sender = sock.recvfrom(4096)
    query = dns.message.from_wire(data)
    reply = dns.message.make_response(query)
    question = query.question[0]
    if question.name.to_text() != "backbone.":
        reply.set_rcode(dns.rcode.NXDOMAIN)
    elif question.rdtype == 1:  # A; other types get an empty answer
        reply.answer.append(dns.rrset.from_text("backbone.", 5, "IN", "A", "127.0.0.1"))
    sock.sendto(reply.to_wire(), sender)
"""


@pytest.mark.slow
@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"),
    reason="needs root, unshare and ip for a private mount and network namespace",
)
def test_compose_peers_join_a_backbone_by_its_dns4_address(tmp_path):
    """What the compose peers do, with a toy DNS server standing in for Docker's: resolve
    /dns4/backbone, join, train a step, and read the collaboration's status."""
    (tmp_path / "resolv.conf").write_text("nameserver 127.0.0.1\n")
    (tmp_path / "toy_dns.py").write_text(DNS_SERVER)
    bin_dir = Path(sys.executable).parent
    script = textwrap.dedent(
        f"""\
        set -eu
        # Whatever fails, leave nothing running (the pipes to pytest would stay open).
        trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
        ip link set lo up
        mount --bind {tmp_path}/resolv.conf /etc/resolv.conf
        {sys.executable} {tmp_path}/toy_dns.py > {tmp_path}/dns.log 2>&1 &
        addr=$({bin_dir}/backbone id --address /dns4/backbone/tcp/31337)
        {bin_dir}/backbone start --port 31337 > {tmp_path}/backbone.log 2>&1 &
        backbone=$!
        timeout 120 {bin_dir}/peer join --identity {tmp_path}/peer.key --backbone "$addr" \\
            > {tmp_path}/peer.log 2>&1
        timeout 30 {bin_dir}/peer status --backbone "$addr" --json > {tmp_path}/status.json \\
            2> {tmp_path}/status.log
        # SIGTERM: background jobs of a non-interactive shell ignore SIGINT.
        kill -TERM $backbone && wait $backbone
        echo "$addr"
        """
    )
    env = {
        **os.environ,
        "PEERTRAIN_CONFIG": str(ROOT / "configs" / "debug.toml"),
        "PEERTRAIN_IDENTITY_PATH": str(tmp_path / "identity.key"),
        "PEERTRAIN_TRAINING_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "PEERTRAIN_TRAINING_MAX_STEPS": "1",
    }
    result = subprocess.run(
        ["unshare", "--mount", "--net", "bash", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.log")}
    assert result.returncode == 0, (result.stderr, logs)
    address = result.stdout.strip().splitlines()[-1]
    assert address.startswith("/dns4/backbone/tcp/31337/p2p/")
    assert "joined collaboration" in logs["peer.log"] and "training finished" in logs["peer.log"]
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["collaboration"]["backbones_reached"] == [address.rsplit("/", 1)[1]]
