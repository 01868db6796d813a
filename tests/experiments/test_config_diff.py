"""What differs between two configs, written one way wherever a run is refused for it."""

from experiments.training import config_diff


def test_a_difference_is_key_old_new_with_values_as_json_and_strings_bare():
    assert config_diff.format_difference("model.attention", "linear", "softmax") == (
        "model.attention: linear -> softmax"
    )
    assert config_diff.format_difference("seed", 0, 7) == "seed: 0 -> 7"
    assert config_diff.format_difference("model.options", {"b": None, "a": True}, [1.5]) == (
        'model.options: {"a": true, "b": null} -> [1.5]'
    )


def test_differences_follow_the_old_config_and_name_a_key_the_new_one_lacks():
    old = {"b": 1, "a": 2, "same": 3, "gone": 4}
    new = {"a": 5, "b": 1, "same": 3, "added": 6}
    assert config_diff.differences(old, new) == [("a", 2, 5), ("gone", 4, config_diff.ABSENT)]


def test_config_differences_compare_nested_configs_by_dotted_key_in_order():
    saved = {"seed": 0, "model": {"model_dim": 64, "attention": "linear"}, "data_dir": "/a"}
    config = {"seed": 7, "model": {"model_dim": 48, "attention": "linear", "new_key": 1}}
    assert config_diff.config_differences(saved, config) == [
        "data_dir: /a -> (absent)",
        "model.model_dim: 64 -> 48",
        "seed: 0 -> 7",
    ]
    assert config_diff.config_differences(saved, saved) == []
