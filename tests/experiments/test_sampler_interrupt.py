"""Ctrl-C stops a sampler at once: a real SIGINT delivered while XLA is busy (a compiled loop,
where Python's own handler would not run until it returns) ends the process within a second,
with one line and exit status 130, writing nothing."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

from configs import digits
from experiments import tasks

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def _start(script: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _interrupt_when(process: subprocess.Popen, marker: str, wait: float) -> tuple[float, str]:
    """Wait for `marker` on stdout (after the command's line naming its backend, if it prints
    one), then `wait` s, send SIGINT: -> (seconds to exit, stderr)."""
    line = process.stdout.readline().strip()
    if line.startswith("JAX backend: "):
        line = process.stdout.readline().strip()
    assert line == marker
    time.sleep(wait)
    process.send_signal(signal.SIGINT)
    sent = time.perf_counter()
    try:
        process.wait(timeout=20)
    finally:
        process.kill()
    return time.perf_counter() - sent, process.stderr.read()


def test_a_sigint_while_xla_computes_ends_the_process_within_a_second():
    # A compiled loop of several minutes: without the watcher, SIGINT waits for it to finish.
    process = _start(
        """
        import jax, jax.numpy as jnp
        from experiments.cli import stop_at_once_on_interrupt

        spin = jax.jit(lambda x: jax.lax.fori_loop(0, 2**31 - 1, lambda i, x: x * 0.999 + 1.0, x))
        x = jnp.zeros(256)
        with stop_at_once_on_interrupt():
            result = spin.lower(x).compile()
            print("computing", flush=True)
            result(x).block_until_ready()
        print("finished")
        """
    )
    seconds, stderr = _interrupt_when(process, "computing", wait=1.0)
    assert process.returncode == 128 + signal.SIGINT, stderr
    assert seconds < 1.0, seconds
    assert stderr.strip().splitlines() == ["-c: SIGINT received: stopped, nothing written."], stderr


def test_ctrl_c_in_the_sample_command_is_one_line_and_writes_nothing(tmp_path):
    config = digits.get_config("smoke,num_steps=2,eval_every=0,sample_every=0")
    config.data_dir = str(tmp_path / "tfds")
    workdir = tmp_path / "w"
    tasks.train_and_evaluate(config, workdir)
    out = tmp_path / "grid.png"
    # The real command's main; "sampling" is printed once it is inside the sampling function.
    process = _start(
        f"""
        import sys
        from absl import app
        from experiments import sample

        original = sample.sample_from_workdir

        def announced(*args, **kwargs):
            print("sampling", flush=True)
            return original(*args, **kwargs)

        sample.sample_from_workdir = announced
        sys.argv = ["sample", "--workdir={workdir}", "--num_images=64", "--out={out}"]
        app.run(sample.main)
        """
    )
    seconds, stderr = _interrupt_when(process, "sampling", wait=0.2)
    assert process.returncode == 128 + signal.SIGINT, stderr
    assert seconds < 1.0, seconds
    assert stderr.strip().splitlines()[-1] == "sample: SIGINT received: stopped, nothing written.", stderr
    assert "Traceback" not in stderr and "resume" not in stderr
    assert not out.exists()
