"""The demo entry point's train_and_evaluate on a tiny config."""

from configs import demo as demo_config
from experiments import demo


def test_demo_trains_and_generates_recurrently(tmp_path):
    config = demo_config.get_config()
    config.num_steps = 400
    config.log_every = 100
    config.eval_batch_size = 32
    metrics = demo.train_and_evaluate(config, str(tmp_path))
    assert (tmp_path / "metrics.json").exists()
    assert metrics["final_loss"] < 0.8  # ln(16) = 2.77 at chance
    assert metrics["continuation_accuracy"] > 0.6  # chance is 1/16
    assert metrics["parallel_vs_recurrent_max_abs_diff"] < 1e-4
