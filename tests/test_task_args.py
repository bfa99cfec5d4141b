"""`[task.args]`: keyword arguments of a `package.module:factory` task, from the config file,
the environment or the Python API, checked like every other setting."""

from __future__ import annotations

import functools

import pytest

from peer.config import load_config
from peer.errors import ConfigError
from peer.training.task import TinyTask, load_task


class WideTiny(TinyTask):
    def __init__(self, hidden: int = 128, name: str = "tiny") -> None:
        self.hidden = hidden
        super().__init__()
        self.name = name


def wide(hidden: int = 128, name: str = "tiny") -> WideTiny:
    return WideTiny(hidden, name)


def broken(hidden: int = 1) -> WideTiny:
    return WideTiny(hidden=hidden, unknown=1)  # type: ignore[call-arg]  # the factory's bug


def decorated(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    return wrapper


wrapped = decorated(wide)
not_a_factory = 42

HERE = f"{__name__}"


def test_args_from_the_file_reach_the_factory(tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text(f'[task]\nname = "{HERE}:wide"\n\n[task.args]\nhidden = 32\nname = "w32"\n')
    config = load_config(file=path, env={}).config
    assert config.task.args == {"hidden": 32, "name": "w32"}
    task = load_task(config.task.name, config.task.args)
    assert task.name == "w32"
    assert task.build_model()[0].out_features == 32  # the MLP's hidden layer


def test_args_from_the_environment_are_a_json_object():
    env = {"PEERTRAIN_TASK_NAME": f"{HERE}:wide", "PEERTRAIN_TASK_ARGS": '{"hidden": 16}'}
    config = load_config(env=env).config
    assert load_task(config.task.name, config.task.args).build_model()[0].out_features == 16


@pytest.mark.parametrize(
    "value",
    [
        '{"hidden": {"deep": 1}}',
        '{"not an identifier": 1}',
        "[1, 2]",
        "{broken",
        '{"x": NaN}',
        '{"x": ' + "[" * 100000 + "]" * 100000 + "}",  # deep enough to exhaust the parser
    ],
)
def test_args_that_are_not_a_table_of_plain_values_are_refused(value):
    with pytest.raises(ConfigError, match=r"task\.args") as caught:
        load_config(env={"PEERTRAIN_TASK_ARGS": value})
    assert "\n" not in str(caught.value)


def test_args_the_factory_does_not_take_are_a_config_error_naming_them():
    with pytest.raises(ConfigError, match="wide\\(\\) does not take them"):
        load_task(f"{HERE}:wide", {"depth": 3})
    with pytest.raises(ConfigError, match="takes no arguments"):
        load_task("tiny", {"hidden": 3})


def test_a_decorated_factory_is_checked_against_the_function_it_wraps():
    with pytest.raises(ConfigError, match="does not take them"):
        load_task(f"{HERE}:wrapped", {"depth": 3})
    assert load_task(f"{HERE}:wrapped", {"hidden": 8}).build_model()[0].out_features == 8
    with pytest.raises(ConfigError, match="not callable"):
        load_task(f"{HERE}:not_a_factory")


def test_a_type_error_inside_the_factory_is_its_own_bug_not_a_config_error():
    with pytest.raises(TypeError, match="unknown"):
        load_task(f"{HERE}:broken", {"hidden": 2})
