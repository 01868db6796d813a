"""The trainer keeps its compiled programs in JAX's persistent cache: a second run, a real
second process, loads its training step instead of compiling it."""

import os
import pathlib
import subprocess
import sys

from configs import digits
from experiments.training import mesh

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _train(workdir, cache, data_dir):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PLATFORMS="cpu", JAX_DEBUG_LOG_MODULES="jax._src.compiler")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--config=configs/digits.py:smoke,num_steps=1,eval_every=0,sample_every=0,checkpoint_every=0",
            f"--config.data_dir={data_dir}",
            f"--config.compilation_cache_dir={cache}",
            f"--workdir={workdir}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_second_process_loads_the_training_step_from_the_cache(tmp_path):
    cache = tmp_path / "cache"
    first = _train(tmp_path / "a", cache, tmp_path / "tfds")
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.splitlines()[0].startswith("JAX backend: cpu")
    entries = {p.name for p in cache.iterdir()}
    assert any("train_step" in name for name in entries), sorted(entries)
    second = _train(tmp_path / "b", cache, tmp_path / "tfds")
    assert second.returncode == 0, second.stderr[-2000:]
    hits = [line for line in second.stderr.splitlines() if "cache hit" in line.lower()]
    assert any("train_step" in line for line in hits), second.stderr[-3000:]


def test_a_directory_jax_was_given_is_kept(tmp_path):
    before = mesh.jax.config.jax_compilation_cache_dir
    mesh.jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    try:
        assert mesh.use_compilation_cache(str(tmp_path / "ours")) == str(tmp_path / "theirs")
        assert not (tmp_path / "ours").exists()
    finally:
        mesh.jax.config.update("jax_compilation_cache_dir", before)


def test_the_tests_compile_into_a_directory_of_their_own_run():
    # tests/conftest.py: one cache for the run (a temporary one unless the caller chose it), not
    # the trainer's default in the home directory, which the trainer would otherwise choose here.
    default = digits.get_config().compilation_cache_dir
    directory = mesh.use_compilation_cache(default)
    assert directory == os.environ["JAX_COMPILATION_CACHE_DIR"] != str(pathlib.Path(default).expanduser())
