"""The Triton bit-format kernels equal the pure-torch code bit for bit: on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``), and on a GPU when there is one."""

import os
import subprocess
import sys

import pytest
import torch

from gc_strategy.algos import packing

triton = pytest.importorskip("triton", reason="Triton is not installed (the pure-torch code is used)")

SIZES = [1, 7, 8, 9, 1000, 4099, 70_001]


@pytest.fixture
def kernels():
    """The kernels, on the CPU when this process runs Triton's interpreter (the test below starts one
    that does), else on the GPU; skipped when neither."""
    from gc_strategy.algos import triton_bits

    if triton_bits.INTERPRETED:
        triton_bits.device = torch.device("cpu")
    elif torch.cuda.is_available():
        triton_bits.device = torch.device("cuda")
    else:
        pytest.skip("needs TRITON_INTERPRET=1 (see test_kernels_under_the_interpreter) or a CUDA GPU")
    return triton_bits


def test_kernels_under_the_interpreter():
    """The kernel tests of this file in a child pytest with TRITON_INTERPRET=1 set before Triton is
    imported (the interpreter cannot be switched on inside a process that imported Triton without it)."""
    from gc_strategy.algos import triton_bits

    if triton_bits.INTERPRETED:
        pytest.skip("already under the interpreter")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                           "-k", "not under_the_interpreter and not without_the_interpreter"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-1000:]


def _reference_pack(codes, bits):
    """packing.pack_bits's torch path, whatever the dispatch."""
    per_byte = 8 // bits
    codes = codes.reshape(-1).to(torch.uint8).cpu()
    codes = torch.cat([codes, codes.new_zeros((-codes.numel()) % per_byte)])
    return (codes.view(-1, per_byte).long() << torch.arange(0, 8, bits)).sum(1).to(torch.uint8)


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("n", SIZES)
def test_pack_and_unpack_equal_the_torch_code(kernels, bits, n):
    g = torch.Generator().manual_seed(n * bits)
    codes = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.uint8).to(kernels.device)
    packed = kernels.pack_bits(codes, bits)
    assert torch.equal(packed.cpu(), _reference_pack(codes, bits))
    assert torch.equal(kernels.unpack_bits(packed, bits, n).cpu(), codes.cpu())


@pytest.mark.parametrize("n", SIZES)
def test_pack_signs_equals_the_comparison(kernels, n):
    g = torch.Generator().manual_seed(n)
    values = torch.randn(n, generator=g)
    values[::5] = 0.0
    values[1::7] = -0.0
    if n > 3:
        values[3] = float("nan")  # NaN >= 0 is False, in torch and in the kernel
    values = values.to(kernels.device)
    assert torch.equal(kernels.pack_signs(values).cpu(), _reference_pack(values.cpu() >= 0, 1))
    assert torch.equal(kernels.pack_bits(values >= 0, 1).cpu(), _reference_pack(values.cpu() >= 0, 1))


def test_the_torch_code_is_used_on_the_cpu_without_the_interpreter():
    from gc_strategy.algos import triton_bits

    if triton_bits.INTERPRETED:
        pytest.skip("this session runs Triton's interpreter")
    assert not triton_bits.usable(torch.zeros(3))
    codes = torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=torch.uint8)
    assert packing.pack_bits(codes, 1).tolist() == [0b10001101, 0b1]
    assert packing.pack_signs(torch.tensor([1.0, -1.0, 0.0])).tolist() == [0b101]


@pytest.mark.parametrize("name", ["onebit", "efsignsgd"])
@pytest.mark.parametrize("ranks", [1, 3])
def test_mean_of_signs_equals_the_mean_of_the_decodes(kernels, name, ranks):
    """The Triton aggregate of the scaled sign methods against their torch decode-and-average."""
    from gc_strategy.algos import COMPRESSORS
    from gc_strategy.bucket import Bucket

    bucket = Bucket(0, ["a", "b", "c"], [torch.Size([7, 3]), torch.Size([5]), torch.Size([40, 33])], torch.float32,
                    kernels.device)
    compressor = COMPRESSORS.build(name)
    g = torch.Generator().manual_seed(ranks)
    gathered = [compressor.encode(torch.randn(bucket.numel, generator=g).to(kernels.device), bucket) for _ in range(ranks)]
    bits = torch.stack([payload[-1] for payload in gathered])
    pairs = [compressor.level_pair(payload[0]) for payload in gathered]
    positive, negative = (torch.stack([pair[k] for pair in pairs]) for k in (0, 1))
    fused = kernels.mean_of_signs(bits, positive, negative, bucket.tensor_ids(kernels.device), bucket.numel)
    expected = compressor.decode(gathered[0], bucket).clone()
    for payload in gathered[1:]:
        expected += compressor.decode(payload, bucket)
    assert torch.equal(fused.cpu(), expected.div_(ranks).cpu())
