"""The kernel-resources tool (`experiments/benchmarking/kernel_resources.py`): the Pallas kernels
lowered as on a GPU give their Triton IR here, and Triton compiles every one of them for an
H100 (sm_90) with ptxas's figures read back."""

import csv

import pytest

from experiments.benchmarking import kernel_resources


def test_both_kernels_give_their_triton_ir_without_a_gpu():
    modules = kernel_resources.triton_modules(
        "step", n=32, head_dim=16, dtype="bfloat16", chunk_size=16, tuning={}
    )
    assert set(modules) == {"forward_kernel", "backward_kernel"}
    assert all(text.startswith("module @") and "tt.func public" in text for text in modules.values())


def test_triton_compiles_every_decay_for_an_h100(tmp_path):
    """Each kernel compiles with the installed Triton (Triton 3.6 once failed an assertion in
    its scan lowering on the step decay's [C, 1] prefix sums), and ptxas says what it uses."""
    pytest.importorskip("triton")
    opts = kernel_resources.KernelResourcesOptions(
        value_blocks=(0,), num_warps=(4,), n=32, head_dim=16, chunk_size=16
    )
    rows = kernel_resources.run(opts, tmp_path, log=lambda line: None)
    assert [(r["kernel"], r["decay"]) for r in rows] == [
        (kernel, decay) for decay in kernel_resources.DECAYS for kernel in ("forward", "backward")
    ]
    for row in rows:
        assert row["status"] == "ok", row
        assert 0 < row["registers"] <= 255 and row["smem_bytes"] > 0
        assert row["mma_instructions"] > 0 and row["shared_loads"] > 0
    with open(tmp_path / "kernel_resources.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert "for sm_90" in (tmp_path / "kernel_resources.md").read_text()


def test_the_normalised_kernels_compile_too(tmp_path):
    """The paper's attention (elu, the normaliser in the values' programs) through the same
    kernels."""
    pytest.importorskip("triton")
    opts = kernel_resources.KernelResourcesOptions(
        decays=("step",), value_blocks=(0,), num_warps=(4,), n=32, head_dim=16, chunk_size=16, normalize=True
    )
    rows = kernel_resources.run(opts, tmp_path, log=lambda line: None)
    assert [r["kernel"] for r in rows] == ["forward", "backward"]
    assert all(r["status"] == "ok" for r in rows), rows
    assert "elu features, normalised" in (tmp_path / "kernel_resources.md").read_text()


@pytest.mark.parametrize("parallel,walks", [(True, 1), (True, 2), (False, 2)])
def test_the_parallel_kernels_and_the_walks_compile_too(tmp_path, parallel, walks):
    """The parallel forward's and backward's kernels (states, then one program a chunk), with a
    decay per feature (its per-chunk choice of form) and the normaliser, the chunks walked in
    one stretch or two (each walk's kernel writing factors, each chunk's adding its walk's
    first state); and the one-pass kernels walking two stretches, each after a kernel that
    walks them from zero, writing only their ends."""
    pytest.importorskip("triton")
    opts = kernel_resources.KernelResourcesOptions(
        decays=("feature",),
        value_blocks=(0,),
        num_warps=(4,),
        n=32,
        head_dim=16,
        chunk_size=16,
        normalize=True,
        parallel=parallel,
        walks=walks,
    )
    rows = kernel_resources.run(opts, tmp_path, log=lambda line: None)
    kernels = ["chunk_states", "chunk_outputs", "backward_states", "chunk_gradients"]
    if not parallel:
        kernels = ["chunk_states", "forward", "backward_states", "backward"]
    assert [r["kernel"] for r in rows] == kernels
    assert all(r["status"] == "ok" for r in rows), rows


def test_tf32_products_take_twice_the_tensor_core_instructions(tmp_path):
    """The matmul precision the kernels are traced at: bfloat16 inputs multiply in bfloat16 by
    default (k = 16 a tensor-core instruction), TF32 asked for takes twice the instructions."""
    pytest.importorskip("triton")

    def mma(precision):
        opts = kernel_resources.KernelResourcesOptions(
            decays=("none",),
            value_blocks=(0,),
            num_warps=(4,),
            n=32,
            head_dim=16,
            chunk_size=16,
            matmul_precision=precision,
        )
        rows = kernel_resources.run(opts, tmp_path / (precision or "default"), log=lambda line: None)
        return {r["kernel"]: r["mma_instructions"] for r in rows}

    bf16, tf32 = mma(""), mma("tensorfloat32")
    assert tf32 == {kernel: 2 * n for kernel, n in bf16.items()}, (bf16, tf32)
    text = (tmp_path / "tensorfloat32" / "kernel_resources.md").read_text()
    assert "matmul precision tensorfloat32" in text


def test_ptx_instructions_are_counted():
    ptx = """
\twgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%r1}, %rd1, %rd2;
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r2}, {%r3}, {%f2};
\t@%p1 ld.shared.v4.b32 {%r4, %r5, %r6, %r7}, [%r8];
\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r9}, [%r10];
\tst.shared.b32 [%r11], %r12;
\tld.global.b32 %r13, [%rd3];
"""
    assert kernel_resources.ptx_counts(ptx) == {"mma_instructions": 2, "shared_loads": 2}


def test_ptxas_reports_are_read_and_a_short_one_is_refused():
    info = (
        "ptxas info    : Function properties for forward_kernel\n"
        "    40 bytes stack frame, 36 bytes spill stores, 32 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 1 barriers, 40 bytes cumulative stack size\n"
    )
    assert kernel_resources.ptxas_usage(info) == {
        "registers": 255,
        "spill_stores": 36,
        "spill_loads": 32,
        "stack_bytes": 40,
    }
    with pytest.raises(
        ValueError, match=r"ptxas -v reported no \['spill_stores', 'spill_loads', 'stack_bytes'\]"
    ):
        kernel_resources.ptxas_usage("ptxas info    : Used 12 registers")


def test_options_refuse_unknown_decays_bad_value_blocks_and_unknown_gpus():
    with pytest.raises(ValueError, match=r"unknown or no decays \['gate'\]"):
        kernel_resources.KernelResourcesOptions(decays=("gate",))
    with pytest.raises(ValueError, match="value_block must be a power of two >= 16 or None, got 24"):
        kernel_resources.KernelResourcesOptions(value_blocks=(24,))
    with pytest.raises(ValueError, match="walks must be an int >= 1, got 0"):
        kernel_resources.KernelResourcesOptions(walks=0)
    with pytest.raises(ValueError, match=r"arch must be one of \[80, 90, 100\], got 75"):
        kernel_resources.KernelResourcesOptions(arch=75)
    with pytest.raises(ValueError, match="must be None or in .*'tensorfloat32'.*got bf32"):
        kernel_resources.KernelResourcesOptions(matmul_precision="bf32")
