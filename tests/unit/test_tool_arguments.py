"""A tool call's arguments: a JSON object, or an error the policy sees (never an exception)."""
import pytest

from shoal.rollout.tools import Observation, parse_arguments


def test_a_json_object_or_a_dict_is_the_arguments():
    assert parse_arguments('{"path": "a.py"}') == {"path": "a.py"}
    assert parse_arguments({"cmd": "ls"}) == {"cmd": "ls"}


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", '"text"', "3"])
def test_bad_arguments_are_an_error_observation(bad):
    obs = parse_arguments(bad)
    assert isinstance(obs, Observation) and obs.error and "not valid JSON" in obs.text
