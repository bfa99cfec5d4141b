"""Config loading: layer precedence, recorded sources, and one-line errors that name the culprit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from peer.config import (
    FIELDS,
    DhtConfig,
    PeerConfig,
    PresenceConfig,
    config_to_dict,
    load_config,
)
from peer.errors import ConfigError, UserError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def write(tmp_path: Path, text: str, name: str = "peer.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def config_error(**kwargs: object) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    assert isinstance(info.value, UserError)
    return message


# --- defaults and shipped files ----------------------------------------------------------------


def test_defaults_without_any_layer() -> None:
    loaded = load_config()
    assert loaded.config == PeerConfig()
    assert loaded.config.net.listen == ["/ip4/0.0.0.0/tcp/0"]
    assert loaded.config.dht.replicas == 8
    assert set(loaded.sources.values()) == {"default"}
    assert "net.listen" in loaded.sources and "log.format" in loaded.sources
    assert set(loaded.sources) == {f"{s}.{k}" for s, keys in FIELDS.items() for k in keys}


def test_default_toml_sets_every_key_to_its_default() -> None:
    path = CONFIGS / "default.toml"
    loaded = load_config(file=path)
    assert loaded.config == PeerConfig()
    # Every key is present in the file, so every source is the file.
    assert set(loaded.sources.values()) == {f"file {path}"}


def test_debug_toml_is_fast() -> None:
    config = load_config(file=CONFIGS / "debug.toml").config
    assert config.presence.ttl == 4.0
    assert config.presence.refresh == 1.0
    assert config.net.listen == ["/ip4/127.0.0.1/tcp/0"]
    assert config.dht.purge_interval == 1.0
    assert config.log.level == "info"


def test_config_to_dict_is_plain_nested() -> None:
    data = config_to_dict(PeerConfig())
    assert data["dht"]["bucket_size"] == 20
    assert data["net"]["listen"] == ["/ip4/0.0.0.0/tcp/0"]
    assert data["collaboration"] == {"name": "default", "backbones": [], "network_key": ""}
    data["net"]["listen"].append("/x")  # a copy: the frozen config is untouched
    assert PeerConfig().net.listen == ["/ip4/0.0.0.0/tcp/0"]


# --- precedence and sources --------------------------------------------------------------------


def test_each_layer_overrides_the_one_below(tmp_path: Path) -> None:
    path = write(
        tmp_path, "[dht]\nreplicas = 5\nalpha = 2\nbucket_size = 10\n[log]\nlevel = 'debug'\n"
    )
    env = {"PEERTRAIN_DHT_ALPHA": "4", "PEERTRAIN_DHT_BUCKET_SIZE": "12"}
    overrides = {"dht.bucket_size": 16, "collaboration.name": None}
    loaded = load_config(file=path, env=env, overrides=overrides)
    dht = loaded.config.dht
    assert (dht.replicas, dht.alpha, dht.bucket_size) == (5, 4, 16)
    assert loaded.config.log.level == "debug"
    assert loaded.config.collaboration.name == "default"  # None override = flag not given
    assert loaded.sources["dht.replicas"] == f"file {path}"
    assert loaded.sources["dht.alpha"] == "env PEERTRAIN_DHT_ALPHA"
    assert loaded.sources["dht.bucket_size"] == "flag"
    assert loaded.sources["collaboration.name"] == "default"
    assert loaded.sources["dht.max_ttl"] == "default"


def test_env_lists_are_comma_separated() -> None:
    env = {"PEERTRAIN_NET_LISTEN": "/ip4/127.0.0.1/tcp/0, /ip4/127.0.0.1/tcp/5000"}
    loaded = load_config(env=env)
    assert loaded.config.net.listen == ["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/tcp/5000"]
    assert loaded.sources["net.listen"] == "env PEERTRAIN_NET_LISTEN"
    assert load_config(env={"PEERTRAIN_NET_ANNOUNCE": ""}).config.net.announce == []


def test_env_numbers_and_ints_as_floats() -> None:
    env = {"PEERTRAIN_NET_RPC_TIMEOUT": "2", "PEERTRAIN_PRESENCE_TTL": "60.5"}
    config = load_config(env=env).config
    assert config.net.rpc_timeout == 2.0 and isinstance(config.net.rpc_timeout, float)
    assert config.presence.ttl == 60.5


def test_peertrain_config_env_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[collaboration]\nname = 'mnist'\n")
    loaded = load_config(env={"PEERTRAIN_CONFIG": str(path)})
    assert loaded.config.collaboration.name == "mnist"
    assert loaded.sources["collaboration.name"] == f"file {path}"


def test_explicit_file_beats_peertrain_config(tmp_path: Path) -> None:
    a = write(tmp_path, "[collaboration]\nname = 'a'\n", "a.toml")
    b = write(tmp_path, "[collaboration]\nname = 'b'\n", "b.toml")
    assert load_config(file=a, env={"PEERTRAIN_CONFIG": str(b)}).config.collaboration.name == "a"


def test_unrelated_env_is_ignored() -> None:
    assert load_config(env={"HOME": "/root", "PEERTRAINX": "1"}).config == PeerConfig()


def test_flags_take_lists_and_lowercase_enums() -> None:
    loaded = load_config(overrides={"net.listen": ("/ip4/127.0.0.1/tcp/7",), "log.level": "DEBUG"})
    assert loaded.config.net.listen == ["/ip4/127.0.0.1/tcp/7"]
    assert loaded.config.log.level == "debug"


# --- errors ------------------------------------------------------------------------------------


def test_env_wrong_type_names_key_value_expectation_and_source() -> None:
    message = config_error(env={"PEERTRAIN_NET_CONNECT_TIMEOUT": "abc"})
    assert message == (
        "net.connect_timeout = 'abc' (from env PEERTRAIN_NET_CONNECT_TIMEOUT): expected a number"
    )


def test_env_float_for_int_field() -> None:
    message = config_error(env={"PEERTRAIN_DHT_REPLICAS": "5.5"})
    assert "dht.replicas" in message and "'5.5'" in message and "expected an integer" in message


def test_unknown_key_in_file_lists_known_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "[dht]\nreplica = 3\n")
    message = config_error(file=path)
    assert message.startswith(f"unknown key 'dht.replica' in file {path}: known keys in [dht] are ")
    assert "alpha, bucket_size" in message and "replicas" in message


def test_unknown_section_in_file(tmp_path: Path) -> None:
    message = config_error(file=write(tmp_path, "[dhtt]\nalpha = 3\n"))
    assert "[dhtt]" in message and "dht" in message and "presence" in message


def test_section_must_be_a_table(tmp_path: Path) -> None:
    message = config_error(file=write(tmp_path, "dht = 3\n"))
    assert "dht = 3" in message and "expected a [dht] table" in message


def test_unknown_env_key_and_section() -> None:
    message = config_error(env={"PEERTRAIN_DHT_REPLICA": "3"})
    assert "dht.replica" in message and "env PEERTRAIN_DHT_REPLICA" in message
    assert "replicas" in message
    message = config_error(env={"PEERTRAIN_NOPE": "1"})
    assert "PEERTRAIN_NOPE" in message and "PEERTRAIN_CONFIG" in message


def test_unknown_flag_key() -> None:
    message = config_error(overrides={"net.listn": ["/ip4/1.2.3.4/tcp/1"]})
    assert "net.listn" in message and "flag" in message and "listen" in message


@pytest.mark.parametrize(
    ("toml", "key", "shown", "expected"),
    [
        ("[dht]\nalpha = true", "dht.alpha", "True", "expected an integer"),
        ("[dht]\nalpha = 2.5", "dht.alpha", "2.5", "expected an integer"),
        ("[dht]\nalpha = 0", "dht.alpha", "0", "expected an integer >= 1"),
        ("[metrics]\nport = 65536", "metrics.port", "65536", ">= 0 and <= 65535"),
        ("[metrics]\nport = -1", "metrics.port", "-1", ">= 0 and <= 65535"),
        ("[net]\nrpc_timeout = -1", "net.rpc_timeout", "-1.0", "expected a number > 0"),
        ("[net]\nrpc_timeout = true", "net.rpc_timeout", "True", "expected a number"),
        ("[net]\nrpc_timeout = nan", "net.rpc_timeout", "nan", "expected a number > 0"),
        ("[net]\nlisten = '/ip4/1.2.3.4/tcp/1'", "net.listen", "'/ip4/", "expected a list"),
        ("[net]\nlisten = [1]", "net.listen", "[1]", "expected a list of strings"),
        ("[net]\nlisten = ['tcp/1']", "net.listen", "['tcp/1']", "starting with '/'"),
        ("[log]\nlevel = 'loud'", "log.level", "'loud'", "expected one of debug, info"),
        ("[log]\nformat = 'xml'", "log.format", "'xml'", "expected one of rich, json"),
        ("[collaboration]\nname = 3", "collaboration.name", "3", "expected a string"),
        ("[collaboration]\nname = ''", "collaboration.name", "''", "non-empty"),
    ],
)
def test_bad_file_values(tmp_path: Path, toml: str, key: str, shown: str, expected: str) -> None:
    path = write(tmp_path, toml + "\n")
    message = config_error(file=path)
    assert message.startswith(f"{key} = {shown}")
    assert f"(from file {path})" in message
    assert expected in message


def test_int_accepted_for_float(tmp_path: Path) -> None:
    config = load_config(file=write(tmp_path, "[presence]\nttl = 40\n")).config
    assert config.presence.ttl == 40.0 and isinstance(config.presence.ttl, float)


def test_bool_flag_rejected_for_int() -> None:
    message = config_error(overrides={"dht.alpha": True})
    assert message == "dht.alpha = True (from flag): expected an integer"


def test_refresh_must_be_below_ttl_across_layers(tmp_path: Path) -> None:
    path = write(tmp_path, "[presence]\nttl = 20\n")
    message = config_error(file=path, env={"PEERTRAIN_PRESENCE_REFRESH": "20"})
    assert message.startswith("presence.refresh = 20.0 (from env PEERTRAIN_PRESENCE_REFRESH)")
    assert "less than presence.ttl" in message and f"20.0 from file {path}" in message


def test_replicas_at_most_bucket_size() -> None:
    message = config_error(overrides={"dht.replicas": 21})
    assert "dht.replicas = 21 (from flag)" in message and "dht.bucket_size" in message
    assert load_config(overrides={"dht.replicas": 20}).config.dht.replicas == 20


def test_min_group_size_at_most_the_signatures_a_record_carries() -> None:
    """A step is certified by min_group_size signatures in one record, which carries at most
    16: a quorum of 20 could never be met, and no step would count."""
    big = {"averaging.group_size": 32}
    message = config_error(overrides={**big, "averaging.min_group_size": 17})
    assert "averaging.min_group_size = 17 (from flag)" in message and "at most 16" in message
    ok = load_config(overrides={**big, "averaging.min_group_size": 16}).config
    assert ok.averaging.min_group_size == 16


def test_toml_syntax_error_names_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[dht\nalpha = 3\n")
    message = config_error(file=path)
    assert str(path) in message and "not valid TOML" in message and "line 1" in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    message = config_error(file=path)
    assert str(path) in message and "does not exist" in message


def test_directory_is_not_a_config_file(tmp_path: Path) -> None:
    message = config_error(file=tmp_path)
    assert str(tmp_path) in message


# --- direct construction -----------------------------------------------------------------------


def test_sections_validate_when_built_in_code() -> None:
    with pytest.raises(ConfigError, match=r"presence\.refresh"):
        PresenceConfig(ttl=5.0, refresh=5.0)
    with pytest.raises(ConfigError, match=r"dht\.replicas"):
        dataclasses.replace(DhtConfig(), replicas=30)
    assert dataclasses.replace(DhtConfig(), purge_interval=3600).purge_interval == 3600.0


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PeerConfig().dht.alpha = 5  # type: ignore[misc]
