"""The Triton kernels equal the pure-torch code: on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``), and on a GPU when there is one. Every kernel launch the interpreted tests
make is then compiled for an A100 and an H100/H200 by Triton's own compiler, which needs no GPU: the
code a GPU runs is built in CI, where the interpreter alone would miss what only the compiler refuses
(a type that differs between the branches of a runtime ``if``, for one)."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
from compressor_helpers import finish

from gc_strategy.kernels import pack_bits, pack_signs

triton = pytest.importorskip("triton", reason="Triton is not installed (the pure-torch code is used)")

SIZES = [1, 7, 8, 9, 1000, 4099, 70_001]


@pytest.fixture
def kernels():
    """The kernels, on the CPU when this process runs Triton's interpreter (the test below starts one
    that does), else on the GPU; skipped when neither."""
    from gc_strategy.kernels import triton_bits

    if triton_bits.INTERPRETED:
        triton_bits.device = torch.device("cpu")
    elif torch.cuda.is_available():
        triton_bits.device = torch.device("cuda")
    else:
        pytest.skip("needs TRITON_INTERPRET=1 (see test_kernels_under_the_interpreter) or a CUDA GPU")
    return triton_bits


@pytest.fixture(scope="module", autouse=True)
def recorded_launches():
    """In the interpreter's child process with ``GC_TRITON_LAUNCHES`` set: every kernel launch, its
    kernel and the types (constexprs: the values) of its arguments, written there as JSON at the end."""
    from gc_strategy.kernels import triton_bits

    path = os.environ.get("GC_TRITON_LAUNCHES")
    if not (triton_bits.INTERPRETED and path):
        yield
        return
    import inspect

    from triton.runtime import interpreter
    from triton.runtime.jit import mangle_type

    launches, launch = set(), interpreter.GridExecutor.__call__

    def recorded(self, *args, **kwargs):
        named = inspect.getcallargs(self.fn, *args, **{k: v for k, v in kwargs.items() if k in self.arg_names})
        types = {name: value if name in self.constexprs else mangle_type(value) for name, value in named.items()}
        launches.add(json.dumps([self.fn.__module__, self.fn.__name__, types]))
        return launch(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = recorded
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = launch
        with open(path, "w") as file:
            json.dump(sorted(launches), file)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """The kernel tests of this file in a child pytest with TRITON_INTERPRET=1 set before Triton is
    imported (the interpreter cannot be switched on inside a process that imported Triton without
    it): the child's result and the launches it made."""
    from gc_strategy.kernels import triton_bits

    if triton_bits.INTERPRETED:
        pytest.skip("already under the interpreter")
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 8):
        # seen with Triton 3.6 (torch 2.11): "only 0-dimensional arrays can be converted to Python
        # scalars" at the per-tensor sums' loop over a block's tensors; compiled, they pass there
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run a loop with runtime bounds (3.8's can)")
    path = tmp_path_factory.mktemp("launches") / "launches.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "GC_TRITON_LAUNCHES": str(path)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "not under_the_interpreter and not without_the_interpreter and not compiles_for_the_gpus",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done, [json.loads(launch) for launch in json.loads(path.read_text())] if path.exists() else []


def test_kernels_under_the_interpreter(interpreted):
    done, _ = interpreted
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-1000:]


@pytest.mark.parametrize("capability", [80, 90], ids=["A100", "H100/H200"])
def test_every_kernel_launch_compiles_for_the_gpus(interpreted, capability):
    """Each kernel as the interpreted tests launched it (its argument types, its constexprs) built
    by Triton's compiler for an A100 (sm_80) and an H100/H200 (sm_90), down to the GPU's binary
    (``ptxas``), without a GPU; and every kernel of the layer was launched."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _, launches = interpreted
    kernels = set()
    for module, name, types in launches:
        kernel = getattr(importlib.import_module(module), name)
        constant = {param.name for param in kernel.params if param.is_constexpr}
        signature = {arg: "constexpr" if arg in constant else t for arg, t in types.items()}
        constexprs = {arg: types[arg] for arg in constant}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", capability, 32))
        assert compiled.asm["cubin"]
        kernels.add(f"{module}.{name}")
    layer = [
        f"{module.__name__}.{name}"
        for module in (
            importlib.import_module(f"gc_strategy.kernels.{m}")
            for m in ("triton_bits", "triton_select", "triton_memory")
        )
        for name, value in vars(module).items()
        if isinstance(value, triton.runtime.jit.JITFunction) and name.endswith("_kernel")
    ]
    assert layer and set(layer) <= kernels, sorted(set(layer) - kernels)


def _reference_pack(codes, bits):
    """kernels.pack_bits's packing, computed plainly."""
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


@pytest.mark.parametrize("chunk, kept", [(1, 1), (7, 3), (64, 6), (256, 2), (1000, 16), (4096, 5)])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_chunk_top_k_keeps_the_largest_of_each_row(kernels, chunk, kept, ties):
    """Against ``torch.topk`` per row: the same multiset of values (with ties, torch may take
    other columns of equal value), ``kept`` distinct columns per row; a row's NaN is taken first,
    as torch ranks it, and the rows past a program's tile are done too (37 rows)."""
    from gc_strategy.kernels import triton_select

    g = torch.Generator().manual_seed(chunk * kept)
    magnitudes = torch.randint(0, 4, (37, chunk), generator=g).float() if ties else torch.rand(37, chunk, generator=g)
    magnitudes[5, chunk // 2] = float("nan")
    chosen = triton_select.chunk_top_k(magnitudes.to(kernels.device), kept).cpu()
    assert chosen.shape == (37, kept) and chosen.dtype == torch.int64
    assert bool((chosen.sort(1).values.diff(dim=1) > 0).all())
    taken = magnitudes.gather(1, chosen).nan_to_num(nan=float("inf")).sort(1).values
    expected = magnitudes.topk(kept, dim=1).values.nan_to_num(nan=float("inf")).sort(1).values
    assert torch.equal(taken, expected)
    assert int(chosen[5, 0]) == chunk // 2


@pytest.mark.parametrize("value_bits", [0, 2])
def test_chunked_topk_through_the_kernel_equals_the_torch_code(kernels, value_bits):
    """``topk`` in chunks of 256 (the last one short), its values as they are or in SparseLoCo's
    2 bits: the payload and the decode through the kernel equal those of ``torch.topk``'s rows."""
    from gc_strategy import kernels as layer
    from gc_strategy.algos import COMPRESSORS
    from gc_strategy.bucket import Bucket

    bucket = Bucket(0, ["a", "b"], [torch.Size([40, 250]), torch.Size([77])], torch.float32, kernels.device)
    g = torch.randn(bucket.numel, generator=torch.Generator().manual_seed(value_bits)).to(kernels.device)
    results = []
    for variant in ("triton", "torch"):
        compressor = COMPRESSORS.build("topk", density=0.01, chunk=256, value_bits=value_bits)
        with layer.forced(variant):
            payload = compressor.encode(g.clone(), bucket)
            results.append(([p.cpu() for p in payload], compressor.decode(payload, bucket).cpu()))
    (fused, fused_decode), (plain, plain_decode) = results
    assert torch.equal(fused_decode, plain_decode) and int(fused_decode.count_nonzero()) > 0
    # the kernel's columns come in decreasing magnitude, torch's in any order: the same set per chunk
    rows = 10_077 // 256

    def per_chunk(indices):
        return indices[: rows * 2].view(rows, 2).sort(1).values

    assert torch.equal(per_chunk(fused[-1]), per_chunk(plain[-1]))


def test_the_torch_code_is_used_on_the_cpu_without_the_interpreter():
    from gc_strategy.kernels import triton_bits

    if triton_bits.INTERPRETED:
        pytest.skip("Triton's interpreter is on (TRITON_INTERPRET=1)")
    assert not triton_bits.usable(torch.zeros(3))
    codes = torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 1], dtype=torch.uint8)
    assert pack_bits(codes, 1).tolist() == [0b10001101, 0b1]
    assert pack_signs(torch.tensor([1.0, -1.0, 0.0])).tolist() == [0b101]


@pytest.mark.parametrize("name", ["onebit", "efsignsgd"])
@pytest.mark.parametrize("ranks", [1, 3])
def test_mean_of_signs_equals_the_mean_of_the_decodes(kernels, name, ranks):
    """The Triton aggregate of the scaled sign methods against their torch decode-and-average."""
    from gc_strategy.algos import COMPRESSORS
    from gc_strategy.bucket import Bucket

    bucket = Bucket(
        0, ["a", "b", "c"], [torch.Size([7, 3]), torch.Size([5]), torch.Size([40, 33])], torch.float32, kernels.device
    )
    compressor = COMPRESSORS.build(name)
    g = torch.Generator().manual_seed(ranks)
    gathered = [
        compressor.encode(torch.randn(bucket.numel, generator=g).to(kernels.device), bucket) for _ in range(ranks)
    ]
    bits = torch.stack([payload[-1] for payload in gathered])
    pairs = [compressor.level_pair(payload[0]) for payload in gathered]
    positive, negative = (torch.stack([pair[k] for pair in pairs]) for k in (0, 1))
    fused = kernels.mean_of_signs(bits, positive, negative, bucket.boundaries(kernels.device), bucket.numel)
    expected = compressor.decode(gathered[0], bucket).clone()
    for payload in gathered[1:]:
        expected += compressor.decode(payload, bucket)
    assert torch.equal(fused.cpu(), expected.div_(ranks).cpu())


def _sign_bucket(device):
    from gc_strategy.bucket import Bucket

    shapes = [
        torch.Size([7, 3]),
        torch.Size([0]),
        torch.Size([5]),
        torch.Size([1]),
        torch.Size([40, 33]),
        torch.Size([3000]),
    ]
    return Bucket(0, [f"t{i}" for i in range(len(shapes))], shapes, torch.float32, device)


@pytest.mark.parametrize("name", ["onebit", "efsignsgd"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_sign_sums_equal_the_torch_sums(kernels, name, with_residual):
    """Per-tensor sums of g + e (one pass, block partials added atomically: another order of
    additions than the torch code's, so equal to fp32 rounding), over tensors of 0 to 3000 elements."""
    from gc_strategy.algos import COMPRESSORS

    bucket = _sign_bucket(kernels.device)
    g = torch.Generator().manual_seed(3)
    grad = torch.randn(bucket.numel, generator=g).to(kernels.device)
    residual = torch.randn(bucket.numel, generator=g).to(kernels.device) if with_residual else None
    compressor = COMPRESSORS.build(name)
    x = grad + residual if with_residual else grad
    expected = compressor.sums(x.cpu(), _sign_bucket(torch.device("cpu")))
    got = kernels.sign_sums(grad, residual, bucket.boundaries(kernels.device), compressor.split_sums)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["onebit", "efsignsgd"])
def test_sign_encode_equals_pack_decode_and_residual_update(kernels, name):
    """Bits and ``e ← x − decode(bits)`` in one pass, bit for bit against packing + decode + the
    residual memory's update; a bucket that is not finite leaves ``e`` as it was."""
    from gc_strategy.algos import COMPRESSORS, MEMORIES

    bucket = _sign_bucket(kernels.device)
    g = torch.Generator().manual_seed(5)
    compressor, memory = COMPRESSORS.build(name), MEMORIES.build("residual")
    for finite in (True, False):
        grad = torch.randn(bucket.numel, generator=g).to(kernels.device)
        grad[::11] = 0.0
        residual = memory.buffer("residual", bucket)
        residual.copy_(torch.randn(bucket.numel, generator=g))
        before = residual.clone()
        x = memory.compensate(grad, bucket)
        levels = compressor.levels(x, bucket)
        payload = [levels, _reference_pack(x.cpu() >= 0, 1).to(kernels.device)]
        flag = torch.tensor(finite, device=kernels.device)
        expected_residual = before.clone()
        memory.update(x, compressor.decode(payload, bucket), bucket, flag)
        expected_residual, residual_now = residual.clone(), residual
        residual_now.copy_(before)
        bits = kernels.sign_encode(
            grad, residual_now, flag, *compressor.level_pair(levels), bucket.boundaries(kernels.device)
        )
        assert torch.equal(bits.cpu(), payload[1].cpu())
        assert torch.equal(residual_now.cpu(), expected_residual.cpu())
        assert torch.equal(residual_now.cpu(), before.cpu()) is (not finite)


@pytest.mark.parametrize("name", ["onebit", "efsignsgd"])
def test_fused_exchange_equals_the_unfused_one(kernels, name, monkeypatch):
    """Three steps of the residual memory's exchange with the compressor's fused kernel and with it
    switched off (compensate, exchange, update): the same averages and residuals, to fp32 rounding
    of the sums."""
    from gc_strategy.algos import COMPRESSORS, MEMORIES
    from gc_strategy.communicators import COMMUNICATORS

    bucket = _sign_bucket(kernels.device)
    gradients = [
        torch.randn(bucket.numel, generator=torch.Generator().manual_seed(s)).to(kernels.device) for s in range(3)
    ]
    runs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(
                type(COMPRESSORS.build(name)), "encode_with_residual", lambda self, *args, **kwargs: None
            )
        compressor, memory, communicator = (
            COMPRESSORS.build(name),
            MEMORIES.build("residual"),
            COMMUNICATORS.build("allgather"),
        )
        communicator.bind(None)
        runs[fused] = []
        separate, passes = memory.compensated_exchange, []

        def counted(*args, separate=separate, passes=passes):
            passes.append(1)
            return (yield from separate(*args))

        memory.compensated_exchange = counted
        for grad in gradients:
            average, _ = finish(memory.exchange(grad.clone(), bucket, compressor, communicator))
            assert bool(passes) is not fused
            runs[fused].append((average.cpu(), memory.buffer("residual", bucket).cpu().clone()))
    for (a, e), (b, f) in zip(runs[True], runs[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(e, f, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("levels", [1, 5, 127])
def test_qsgd_codes_round_to_a_neighbouring_level_without_bias(kernels, levels):
    """Every code of the one-pass QSGD kernel is the floor or the ceiling of ``s|g|/‖g‖`` with the
    sign of ``g`` (decoded by the torch code), and the mean of 200 draws approaches ``g`` as an
    unbiased quantiser's must (squared error of the mean ≈ Σ var / N)."""
    from gc_strategy.algos import COMPRESSORS

    bucket = _sign_bucket(kernels.device)
    g = torch.randn(bucket.numel, generator=torch.Generator().manual_seed(levels)).to(kernels.device)
    g[::13] = 0.0
    compressor = COMPRESSORS.build("qsgd", levels=levels, chunk=1000)
    norms = torch.nn.functional.pad(g.cpu(), (0, (-g.numel()) % 1000)).view(-1, 1000).norm(dim=1)
    scaled = (g.cpu().abs() * levels / norms.repeat_interleave(1000)[: g.numel()]).double()
    draws = []
    for step in range(200):
        compressor.begin_step(step)
        payload = compressor.encode(g, bucket)
        torch.testing.assert_close(payload[0].cpu(), norms)
        decoded = compressor.decode(payload, bucket).cpu().double()
        level = decoded.abs() * levels / norms.repeat_interleave(1000)[: g.numel()].double()
        assert bool(((level - scaled.floor()).abs() < 1e-4).logical_or((level - scaled.ceil()).abs() < 1e-4).all())
        assert bool((decoded.sign() == g.cpu().sign()).logical_or(decoded == 0).all())
        draws.append(decoded)
    draws = torch.stack(draws)
    squared_error = (draws.mean(0) - g.cpu().double()).square().sum()
    assert float(squared_error / (draws.var(0).sum() / len(draws))) < 1.5


@pytest.mark.parametrize("chunk", [0, 512], ids=["one scale", "512 per scale"])
@pytest.mark.parametrize("clip_sigma", [0.0, 1.0])
def test_terngrad_codes_are_ternary_draws_of_the_clipped_gradient(kernels, clip_sigma, chunk):
    """TernGrad through the same kernel (one level): every decoded value is 0 or ±scale with the sign
    of the clipped gradient, each chunk's scale is its max|clip(g)| (``chunk=0``: one for the
    bucket), and the mean of 200 draws approaches the clipped gradient without bias."""
    from gc_strategy.algos import COMPRESSORS

    bucket = _sign_bucket(kernels.device)
    g = torch.randn(bucket.numel, generator=torch.Generator().manual_seed(7)).to(kernels.device)
    compressor = COMPRESSORS.build("terngrad", clip_sigma=clip_sigma, chunk=chunk)
    clipped = g.cpu().double()
    if clip_sigma:
        bound = clip_sigma * float(g.cpu().std())
        clipped = clipped.clamp(-bound, bound)
    size = chunk or bucket.numel
    expected = torch.stack([piece.abs().max() for piece in clipped.split(size)])
    draws = []
    for step in range(200):
        compressor.begin_step(step)
        payload = compressor.encode(g, bucket)
        scales = payload[0].cpu().double()
        torch.testing.assert_close(scales, expected, rtol=1e-6, atol=0)
        per_element = scales.repeat_interleave(size)[: bucket.numel]
        decoded = compressor.decode(payload, bucket).cpu().double()
        assert bool(((decoded == 0) | ((decoded.abs() == per_element) & (decoded.sign() == clipped.sign()))).all())
        draws.append(decoded)
    draws = torch.stack(draws)
    squared_error = (draws.mean(0) - clipped).square().sum()
    assert float(squared_error / (draws.var(0).sum() / len(draws))) < 1.5


@pytest.mark.parametrize(
    "name, options",
    [("qsgd", dict(levels=127)), ("qsgd", dict(levels=5, chunk=700)), ("qsgd", dict(levels=1)), ("terngrad", {})],
)
@pytest.mark.parametrize("ranks", [1, 3])
def test_mean_of_levels_equals_the_mean_of_the_decodes(kernels, name, options, ranks):
    """The one-pass aggregate of QSGD/TernGrad payloads against the torch decodes' mean."""
    from gc_strategy.algos import COMPRESSORS

    bucket = _sign_bucket(kernels.device)
    compressor = COMPRESSORS.build(name, **options)
    g = torch.Generator().manual_seed(ranks)
    gathered = []
    for rank in range(ranks):
        compressor.bind(compressor.world_size, rank)
        gathered.append(compressor.encode(torch.randn(bucket.numel, generator=g).to(kernels.device), bucket))
    expected = compressor.decode(gathered[0], bucket).clone()
    for payload in gathered[1:]:
        expected += compressor.decode(payload, bucket)
    # compiled, the multiply of a decode may fuse with the addition over ranks (one rounding less)
    torch.testing.assert_close(
        compressor.aggregate(gathered, bucket).cpu(),
        expected.div_(ranks).cpu(),
        rtol=1e-6,
        atol=1e-6 * float(expected.abs().max()),
    )


def _sent_forms(n, device):
    """The forms in which DGC's memory receives the positions sent, each with the bool mask it means:
    int64 and int32 indices, a bool mask of the bucket, and (indices, flags) whose unflagged slots
    repeat a flagged position and an unsent one."""
    g = torch.Generator().manual_seed(n)
    chosen = torch.randperm(n, generator=g)[: n // 10]
    mask = torch.zeros(n, dtype=torch.bool)
    mask[chosen] = True
    indices = torch.cat([chosen, chosen[:3], torch.randperm(n, generator=g)[:5]])
    flags = torch.cat([torch.ones(chosen.numel(), dtype=torch.bool), torch.zeros(8, dtype=torch.bool)])
    forms = {
        "int64": chosen,
        "int32": chosen.int(),
        "mask": mask,
        "flagged": (indices, flags),
    }
    moved = {
        name: tuple(t.to(device) for t in form) if isinstance(form, tuple) else form.to(device)
        for name, form in forms.items()
    }
    return moved, mask


@pytest.mark.parametrize("form", ["int64", "int32", "mask", "flagged"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_dgc_memory_kernels_follow_the_momentum_recursion(kernels, form, grad_dtype):
    """Four steps of DGC's memory through the Triton kernels against its math computed plainly:
    ``u ← m u + g``, ``v ← v + u``, the compressor's input ``v``, then ``u`` and ``v`` zeroed where
    sent; at the third step the gradient holds an inf and a NaN: the input carries them, and ``u``
    and ``v`` stay as they were (nothing zeroed either)."""
    from gc_strategy.algos import MEMORIES
    from gc_strategy.bucket import Bucket

    n, m = 4099, 0.9
    bucket = Bucket(0, ["w"], [torch.Size([n])], torch.float32, kernels.device)
    memory = MEMORIES.build("dgc", momentum=m)
    forms, mask = _sent_forms(n, kernels.device)
    u, v = torch.zeros(n), torch.zeros(n)
    for step in range(4):
        g = torch.randn(n, generator=torch.Generator().manual_seed(step)).to(grad_dtype)
        if step == 2:
            g[5], g[9] = float("inf"), float("nan")
        finite = torch.isfinite(g).all()
        expected = v + (m * u + g.float())
        compensated = memory.compensate(g.to(kernels.device), bucket, finite.to(kernels.device))
        assert compensated is not memory.buffer("v", bucket)  # not the host's in-place path
        memory.update(compensated, forms[form], bucket, finite.to(kernels.device))
        torch.testing.assert_close(compensated.cpu(), expected, rtol=1e-6, atol=1e-6, equal_nan=True)
        if finite:
            u, v = (m * u + g.float()) * ~mask, expected * ~mask
        torch.testing.assert_close(memory.buffer("u", bucket).cpu(), u, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(memory.buffer("v", bucket).cpu(), v, rtol=1e-6, atol=1e-6)
    assert not memory._pending  # the torch code's [2, n] tensors were not made


def _counted(monkeypatch, module, name: str) -> list:
    """``module.name`` replaced by a wrapper that calls it and appends to the list returned."""
    calls, function = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: (calls.append(1), function(*args))[1])
    return calls


@pytest.mark.parametrize(
    "name, memory, options",
    [
        ("dgc", "dgc", dict(density=0.05)),
        ("dgc", "residual", dict(density=0.05)),
        ("threshold", "residual", dict(threshold=0.5, capacity=0.05)),
        ("sidco", "residual", dict(density=0.05)),
        ("topk", "residual", dict(density=0.05)),
        ("topk", "dgc", dict(density=0.05)),
    ],
)
def test_sparsifiers_through_the_kernels_equal_the_torch_code(kernels, monkeypatch, name, memory, options):
    """Three steps of each sparsifier with a memory, exchanged through the Triton kernels (payload,
    selection above a threshold, DGC's memory) and through the torch code: the same positions sent
    and the same averages and memories, to fp32 rounding."""
    from gc_strategy.algos import COMPRESSORS, MEMORIES
    from gc_strategy.communicators import COMMUNICATORS
    from gc_strategy.kernels import forced, triton_select

    calls = _counted(monkeypatch, triton_select, "sparse_payload")
    bucket = _sign_bucket(kernels.device)
    runs = {}
    for variant in ("triton", "torch"):
        compressor, error_feedback = COMPRESSORS.build(name, **options), MEMORIES.build(memory)
        communicator = COMMUNICATORS.build("allgather")
        communicator.bind(None)
        runs[variant] = []
        with forced(variant):
            for step in range(3):
                grad = torch.randn(bucket.numel, generator=torch.Generator().manual_seed(step)).to(kernels.device)
                average, finite = finish(error_feedback.exchange(grad, bucket, compressor, communicator))
                assert bool(finite)
                state = [per_bucket[bucket.index].cpu().clone() for per_bucket in error_feedback.buffers.values()]
                runs[variant].append((average.cpu().clone(), *state))
        assert len(calls) == 3  # the kernels ran in each step of the first run, not in the second
    for triton_run, torch_run in zip(runs["triton"], runs["torch"]):
        assert torch.equal(triton_run[0] != 0, torch_run[0] != 0)  # the same positions sent
        for a, b in zip(triton_run, torch_run):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("on_device", [True, False], ids=["tensor threshold", "float threshold"])
@pytest.mark.parametrize(
    "n, threshold, capacity",
    [(5000, 1.5, 2000), (5000, 0.5, 2000), (5000, 0.5, 300), (70, 0.0, 50), (3000, 9.0, 10)],
    ids=["room to spare", "overflow", "overflow past the candidates", "every entry a candidate", "none above"],
)
def test_select_above_through_the_kernels_equals_the_torch_code(
    kernels, monkeypatch, strict, on_device, n, threshold, capacity
):
    """The same positions, flags and count as the torch variant (the same top-k of the same keys),
    with a NaN and entries equal to the threshold among the magnitudes."""
    from gc_strategy.kernels import forced, select_above, triton_select

    calls = _counted(monkeypatch, triton_select, "select_above")

    magnitudes = torch.randn(n, generator=torch.Generator().manual_seed(n)).abs()
    magnitudes[7] = float("nan")
    magnitudes[11:14] = threshold
    magnitudes = magnitudes.to(kernels.device)
    limit = torch.tensor(threshold, device=kernels.device) if on_device else threshold
    found = {}
    for variant in ("triton", "torch"):
        with forced(variant):
            found[variant] = select_above(magnitudes.clone(), limit, capacity, strict)
    assert len(calls) == 1  # the kernels ran under forced("triton"), not under forced("torch")
    for mine, theirs in zip(found["triton"], found["torch"]):
        assert torch.equal(mine.cpu(), theirs.cpu())
    positions, sent, count = (t.cpu() for t in found["triton"])
    plain = magnitudes.cpu()
    above = torch.isnan(plain) | (plain > threshold if strict else plain >= threshold)
    assert int(count) == int(above.sum()) and bool(above[positions[sent]].all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flagged", [True, False], ids=["with flags", "without flags"])
def test_sparse_payload_through_the_kernel_equals_the_torch_code(kernels, dtype, flagged):
    """The values at the indices (times their flags: 0, −0 for a negative entry, NaN for an inf or
    NaN one) and the int32 indices, bit for bit as the torch code makes them."""
    from gc_strategy.kernels import torch_ops, triton_select

    flat = torch.randn(5000, generator=torch.Generator().manual_seed(1)).to(dtype)
    flat[3], flat[4] = float("inf"), float("nan")
    indices = torch.cat([torch.tensor([3, 4, 3]), torch.randperm(5000, generator=torch.Generator().manual_seed(2))])
    sent = None
    if flagged:
        sent = torch.rand(indices.numel(), generator=torch.Generator().manual_seed(3)) < 0.5
        sent[:3] = torch.tensor([True, False, False])
    moved = [t.to(kernels.device) if t is not None else None for t in (flat, indices, sent)]
    mine, theirs = triton_select.sparse_payload(*moved), torch_ops.sparse_payload(flat, indices, sent)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int32: torch.int32}
    for a, b in zip(mine, theirs):  # bit for bit (-0.0 included), NaN where NaN (its bits may differ)
        a, number = a.cpu(), ~b.isnan() if b.is_floating_point() else torch.ones_like(b, dtype=torch.bool)
        assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a[number].view(bits[a.dtype]), b[number].view(bits[b.dtype]))
    assert mine[0].cpu().isnan()[:3].tolist() == ([False, True, True] if flagged else [False, True, False])
