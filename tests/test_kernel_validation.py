"""The first-use check's bounds (kernels/validation.py): its memory, its exceptions, its stream.

In one process on the CPU, with the stand-in device of tests/test_kernels_first_use.py
(``dispatch.device_type`` calls every tensor a CUDA one):

* a large call is checked on a slice of its arguments: a 16384 x 53248 matrix (the ``meta``
  device: nothing is allocated) goes through the check with no float64 tensor above
  ``CHECK_MAX_ELEMENTS``, and each slice gives every kernel launch the same Triton specialisation
  (integer and pointer facts, constexprs, tiles) as the whole call;
* an exception of the oracle, the reference, the kernel or the comparison is a failed check naming
  the kernel, and the call returns the torch result;
* the shape class separates a dim of 1 and HAS_C (beta zero or not);
* the check synchronises its stream before it reads a result, and a fault that poisons the
  context raises ``DeviceFault`` naming the kernel (a stand-in stream: the CPU has none).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ds_canzona.kernels as K
from ds_canzona.kernels import dispatch, newton_schulz, syrk, validation
from ds_canzona.kernels.newton_schulz import ns_step_reference
from ds_canzona.kernels.shampoo import sym_stat_update_reference
from ds_canzona.kernels.syrk import syrk_reference


@pytest.fixture
def stand_in_cuda(monkeypatch):
    """Backend 'default', every tensor counted as CUDA, Triton 'available', a fresh check state."""
    monkeypatch.setattr(dispatch, "device_type", lambda t: "cuda")
    monkeypatch.setattr(dispatch, "TRITON_AVAILABLE", True)
    before = K.get_backend()
    K.set_backend("default")
    validation.reset()
    dispatch._logged.clear()
    yield
    K.set_backend(before)
    validation.reset()
    dispatch._logged.clear()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "ds_canzona.kernels"]


class _Float64Sizes(TorchDispatchMode):
    """The element count of every float64 tensor any torch operation produces."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                self.sizes.append(t.numel())
        return out


# --- memory: a large call is checked on a slice ------------------------------------------------


@pytest.mark.parametrize("op", ["xxt", "ns_step"])
def test_a_huge_matrix_is_checked_on_a_slice_without_its_float64_oracle(stand_in_cuda, monkeypatch, op):
    x = torch.empty(16384, 53248, dtype=torch.bfloat16, device="meta")  # the matrix; meta: no memory
    kernel_shapes, oracle_shapes, judged = [], [], []

    def kernel(x, *args, out=None, config=None):
        kernel_shapes.append(tuple(x.shape))
        m = x.shape[-2]
        return torch.empty(m, m, dtype=x.dtype, device=x.device) if op == "xxt" else torch.empty_like(x)

    def recorded(reference):
        def wrapper(x, *args, **kwargs):
            if x.dtype == torch.float64:
                oracle_shapes.append(tuple(x.shape))
            return reference(x, *args, **kwargs)
        return wrapper

    def judge(op, got, want, expected):  # a meta tensor cannot be read back: record, pass
        judged.append(tuple(expected.shape))

    monkeypatch.setattr(K, "_syrk_triton" if op == "xxt" else "_ns_step_triton", kernel)
    monkeypatch.setattr(K, "syrk_reference" if op == "xxt" else "ns_step_reference",
                        recorded(syrk_reference if op == "xxt" else ns_step_reference))
    monkeypatch.setattr(validation, "_judge", judge)
    with _Float64Sizes() as float64:
        result = K.xxt(x) if op == "xxt" else K.ns_step(x, 3.4445, -4.775, 2.0315)
    # 16384 and 53248 are multiples of 16 at least 1024: 1024 and the next such length above it
    assert oracle_shapes == [(1024, 1040)]
    assert judged == [(1024, 1024) if op == "xxt" else (1024, 1040)]
    assert kernel_shapes == [(1024, 1040), (16384, 53248)], "the slice is checked, then the call runs whole"
    assert result.shape == ((16384, 16384) if op == "xxt" else (16384, 53248))
    assert max(float64.sizes) <= validation.CHECK_MAX_ELEMENTS, max(float64.sizes)
    status = K.backend_status()[op]
    assert status["validated"] and status["fallback"] is None
    assert status["routes"] == {("triton", "passed its first-use check"): 1}


def test_a_small_call_is_checked_on_its_own_input():
    assert validation.capped_arguments({"x": torch.empty(2, 2048, 2048, device="meta"), "out": None}) is not None
    assert validation.capped_arguments({"x": torch.empty(2048, 2048, device="meta"), "out": None}) is None
    assert validation.capped_arguments({"x": torch.empty(3, 40, 72), "out": None}) is None


def test_capped_sizes_keep_remainders_ones_order_and_the_size_regime():
    sizes = [1, 17, 1000, 1023, 1024, 1039, 1040, 4096, 16384, 16385, 53248]
    capped = validation._capped_sizes(sizes)
    assert [capped[s] for s in sizes] == [1, 17, 1000, 1023, 1024, 1039, 1040, 1056, 1072, 1073, 1088]
    assert capped == validation._capped_sizes(reversed(sizes)), "a mapping of the set, not of the order"
    # in one call (two distinct dims at most) a capped dim is at most 1055
    assert validation._capped_sizes([16383, 16384]) == {16383: 1039, 16384: 1040}
    assert validation._capped_sizes([16399, 16400]) == {16399: 1039, 16400: 1040}
    assert validation._capped_sizes([16399, 16384]) == {16384: 1024, 16399: 1039}
    assert validation._capped_sizes([16384, 16400]) == {16384: 1024, 16400: 1040}
    assert max(validation._capped_sizes([16399, 16415]).values()) == 1055


class _LaunchRecorder:
    """Stands in for a @triton.jit kernel: records the Triton specialisation of each launch.

    An InterpretedFunction to the wrappers' checks (so CPU tensors are taken), never run.
    """

    def __init__(self, launches: list) -> None:
        self.launches = launches

    def __getitem__(self, grid):
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl

        def launch(*args, **constexprs):
            facts = tuple(native_specialize_impl(BaseBackend, a, False, True, True) for a in args)
            self.launches.append((facts, tuple(sorted(constexprs.items(), key=lambda kv: kv[0]))))

        return launch


def _empty(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype)


BF16 = torch.bfloat16
# (name, the Triton wrapper call, its arguments): every argument large enough to be capped
LAUNCH_CASES = [
    ("xxt row-major fp32", lambda x: syrk.syrk(x), lambda: {"x": _empty(2100, 1100)}),
    ("xxt column-major bf16", lambda x: syrk.syrk(x), lambda: {"x": _empty(1100, 2100, dtype=BF16).mT}),
    ("xxt stack of 3, bf16", lambda x: syrk.syrk(x), lambda: {"x": _empty(3, 1200, 1300, dtype=BF16)}),
    ("xxt a row of 1", lambda x: syrk.syrk(x), lambda: {"x": _empty(1, 5000)}),
    ("xxt strided, unaligned", lambda x: syrk.syrk(x),
     lambda: {"x": _empty(1100 * 4200 + 1)[1:].view(1100, 4200)[:, ::2]}),
    ("xxt leading dims copied", lambda x: syrk.syrk(x),
     lambda: {"x": _empty(3, 2, 1100, 1100, dtype=BF16).transpose(0, 1)}),
    ("sym_matmul in place, beta 0.5", lambda a, b, c: syrk.syrk(a, b, alpha=2.0, beta=0.5, c=c, out=c),
     lambda: {"a": _empty(2050, 2050, dtype=BF16), "b": _empty(2050, 2050, dtype=BF16),
              "c": _empty(2050, 2050, dtype=BF16)}),
    ("ns_step wide bf16", lambda x: newton_schulz.ns_step(x, 3.4445, -4.775, 2.0315),
     lambda: {"x": _empty(1100, 4000, dtype=BF16)}),
    ("ns_step tall fp16, a stack", lambda x: newton_schulz.ns_step(x, 3.4445, -4.775, 2.0315),
     lambda: {"x": _empty(3, 2100, 1030, dtype=torch.float16)}),
    ("sym_stat_update_ fp32 stat, bf16 g transposed",
     lambda stat, g: K._sym_stat_update_triton(stat, g, 0.95),
     lambda: {"stat": _empty(2100, 2100), "g": _empty(700, 2100, dtype=BF16).mT}),
    ("coupled_newton_step fp32", lambda x, m: K._coupled_newton_step_triton(x, m, 4),
     lambda: {"x": _empty(2050, 2050), "m": _empty(2050, 2050)}),
]


@pytest.mark.parametrize("name,call,arguments", LAUNCH_CASES, ids=[c[0] for c in LAUNCH_CASES])
def test_the_slice_compiles_the_same_kernel_variant_as_the_whole_call(monkeypatch, name, call, arguments):
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    launches: list = []
    recorder = type("Recorder", (_LaunchRecorder, InterpretedFunction), {})(launches)
    monkeypatch.setattr(syrk, "syrk_kernel", recorder)
    monkeypatch.setattr(newton_schulz, "ns_step_kernel", recorder)
    # the GPU's tile choice (default_config's size regimes), not the interpreter's one config
    monkeypatch.setattr(syrk, "is_interpreted", lambda kernel: False)
    monkeypatch.setattr(newton_schulz, "is_interpreted", lambda kernel: False)
    whole = arguments()
    cut = validation.capped_arguments(whole)
    assert cut is not None, "the case must be large enough to be checked on a slice"
    for t in cut.values():
        assert max(t.shape[-2:]) <= 1055 and t.shape[:-2].numel() <= validation.CHECK_MAX_MATRICES
    assert validation._check_footprint(cut.values()) <= validation.CHECK_MAX_ELEMENTS
    assert validation.shape_class("op", list(cut.values()), None).key == \
        validation.shape_class("op", list(whole.values()), None).key
    call(**whole)
    whole_launches = launches[:]
    launches.clear()
    call(**cut)
    assert launches == whole_launches
    assert len(launches) >= 1


def test_a_slice_is_restored_before_the_call_runs_whole(stand_in_cuda, monkeypatch):
    """The check writes into a slice of the caller's statistic; the call must start from the original."""
    calls = []

    def accurate(stat, g, beta, **kwargs):
        calls.append(tuple(stat.shape))
        return stat.copy_(sym_stat_update_reference(stat.double(), g.double(), beta).to(stat.dtype))

    monkeypatch.setattr(K, "_sym_stat_update_triton", accurate)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(2050, 16, generator=gen)
    stat = torch.randn(2050, 2050, generator=gen)
    stat = stat + stat.T
    expected = accurate(stat.clone(), g, 0.9)
    calls.clear()
    assert K.sym_stat_update_(stat, g, 0.9) is stat
    assert calls == [(1026, 1026), (2050, 2050)]
    assert torch.equal(stat, expected)
    assert K.backend_status()["sym_stat_update_"]["validated"]


# --- every exception in the check is a failed check ----------------------------------------------


@pytest.mark.parametrize("part", ["oracle", "reference", "kernel", "comparison"])
def test_an_exception_anywhere_in_the_check_fails_it_naming_the_kernel(stand_in_cuda, monkeypatch, caplog, part):
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 25.00 GiB")
    raised = []

    def reference(x, *args, **kwargs):  # the oracle's every call; the reference's first (the check's) only
        if part == ("oracle" if x.dtype == torch.float64 else "reference") and not (part == "reference" and raised):
            raised.append(part)
            raise oom
        return syrk_reference(x, *args, **kwargs)

    def judge(*args):
        raise ValueError("cannot read back")

    def kernel(x, *, out=None, config=None):
        if part == "kernel":
            raise oom
        return syrk_reference(x.double()).to(x.dtype)

    monkeypatch.setattr(K, "syrk_reference", reference)
    monkeypatch.setattr(K, "_syrk_triton", kernel)
    if part == "comparison":
        monkeypatch.setattr(validation, "_judge", judge)
    x = torch.randn(24, 40, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.INFO, logger="ds_canzona.kernels"):
        result = K.xxt(x)
    assert torch.equal(result, syrk_reference(x))
    (warning,) = _warnings(caplog)
    expected = {"oracle": "the float64 oracle raised OutOfMemoryError", "reference": "the torch reference raised "
                "OutOfMemoryError", "kernel": "OutOfMemoryError: CUDA out of memory",
                "comparison": "the comparison with float64 raised ValueError: cannot read back"}[part]
    for piece in ("syrk_kernel", "xxt", "[24, 40]", expected, "torch for the rest of this process"):
        assert piece in warning, (piece, warning)
    status = K.backend_status()["xxt"]
    assert status["fallback"] is not None and status["routes"] == {("torch", "failed its first-use check"): 1}


def test_a_reference_that_raises_leaves_the_in_place_argument_as_it_was(stand_in_cuda, monkeypatch):
    def scribbling_then_raising(stat, g, beta):
        stat.fill_(float("nan"))
        raise torch.OutOfMemoryError("CUDA out of memory")

    state = {"calls": 0}

    def reference(stat, g, beta):
        state["calls"] += 1
        return (scribbling_then_raising if state["calls"] == 2 else sym_stat_update_reference)(stat, g, beta)

    monkeypatch.setattr(K, "sym_stat_update_reference", reference)  # call 1: the oracle, call 2: the reference
    monkeypatch.setattr(K, "_sym_stat_update_triton", lambda stat, g, beta, **kw: pytest.fail("the kernel ran"))
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(24, 40, generator=gen)
    stat = torch.eye(24)
    expected = sym_stat_update_reference(stat.clone(), g, 0.9)
    assert K.sym_stat_update_(stat, g, 0.9) is stat
    assert torch.equal(stat, expected)
    assert K.backend_status()["sym_stat_update_"]["fallback"] is not None


def test_an_oracle_out_of_memory_on_a_huge_matrix_falls_back(stand_in_cuda, monkeypatch, caplog):
    def reference(x, *args, **kwargs):
        if x.dtype == torch.float64:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return syrk_reference(x, *args, **kwargs)

    monkeypatch.setattr(K, "syrk_reference", reference)
    monkeypatch.setattr(K, "_syrk_triton", lambda *a, **k: pytest.fail("the kernel ran"))
    x = torch.empty(16384, 53248, dtype=torch.bfloat16, device="meta")
    with caplog.at_level(logging.WARNING, logger="ds_canzona.kernels"):
        assert K.xxt(x).shape == (16384, 16384)
    (warning,) = _warnings(caplog)
    assert "syrk_kernel" in warning and "checked on a slice: [1024, 1040]" in warning
    assert "the float64 oracle raised OutOfMemoryError" in warning


# --- the shape class: a dim of 1, HAS_C ----------------------------------------------------------


def test_the_shape_class_separates_a_dim_of_1_and_has_c():
    def key(op, tensors, constexprs=()):
        return validation.shape_class(op, tensors, None, constexprs).key

    # 1 and 17 leave the same remainder mod 16; Triton makes an argument of 1 a constant
    assert key("xxt", [torch.zeros(1, 72)]) != key("xxt", [torch.zeros(17, 72)])
    assert key("xxt", [torch.zeros(40, 1)]) != key("xxt", [torch.zeros(40, 17)])
    assert key("xxt", [torch.zeros(17, 72)]) == key("xxt", [torch.zeros(33, 72)])
    square = [torch.zeros(40, 40)] * 3
    assert key("sym_matmul", square, (("HAS_C", False),)) != key("sym_matmul", square, (("HAS_C", True),))
    text = validation.shape_class("sym_matmul", square, None, (("HAS_C", False),)).text
    assert text.endswith(", HAS_C=False"), text


def test_beta_zero_and_non_zero_are_checked_apart(stand_in_cuda, monkeypatch):
    checks = []

    def kernel(a, b, *, alpha, beta, c, out, config):
        checks.append(beta)
        return syrk_reference(a.double(), b.double(), alpha=alpha, beta=beta,
                              c=None if c is None else c.double()).to(a.dtype)

    monkeypatch.setattr(K, "_syrk_triton", kernel)
    gen = torch.Generator().manual_seed(3)
    s = torch.randn(40, 40, generator=gen)
    s = s @ s.T / 40
    c = torch.eye(40)
    for beta in (0.0, 0.5, 0.0, 0.25):
        K.sym_matmul(s, s @ s, alpha=0.5, beta=beta, c=c)
    assert checks == [0.0, 0.5, 0.0, 0.25]
    status = K.backend_status()["sym_matmul"]
    assert len(status["validated"]) == 2 and status["routes"][("triton", "passed its first-use check")] == 4
    assert sorted(text.rsplit(", ", 1)[1] for text in status["validated"]) == ["HAS_C=False", "HAS_C=True"]


# --- the stream: synchronised before any result is read -------------------------------------------


class _StandInStream:
    """Records what the check does with its stream; ``fault``: raise at that synchronisation (1-based)."""

    def __init__(self, log: list[str], fault: int | None = None, lost: bool = True) -> None:
        self.log, self.fault, self.lost, self.syncs = log, fault, lost, 0

    def __enter__(self):
        self.log.append("enter")
        return self

    def __exit__(self, *exc):
        self.log.append("exit")

    def synchronize(self):
        self.syncs += 1
        self.log.append("synchronize")
        if self.syncs == self.fault:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def hand_over(self, tensors):
        self.log.append("hand over")

    def context_lost(self):
        self.log.append("context lost?")
        return self.lost


def _logged_xxt(monkeypatch, log):
    def kernel(x, *, out=None, config=None):
        log.append("kernel")
        return syrk_reference(x.double()).to(x.dtype)

    def reference(x, *args, **kwargs):
        log.append("oracle" if x.dtype == torch.float64 else "reference")
        return syrk_reference(x, *args, **kwargs)

    def judge(*args):
        log.append("judge")
        return real_judge(*args)

    real_judge = validation._judge
    monkeypatch.setattr(K, "_syrk_triton", kernel)
    monkeypatch.setattr(K, "syrk_reference", reference)
    monkeypatch.setattr(validation, "_judge", judge)


def test_the_check_synchronises_its_stream_before_reading_a_result(stand_in_cuda, monkeypatch):
    log: list[str] = []
    devices = []
    monkeypatch.setattr(validation, "_check_stream", lambda device: devices.append(device) or _StandInStream(log))
    _logged_xxt(monkeypatch, log)
    K.xxt(torch.randn(24, 40))
    assert devices == [torch.device("cpu")]
    assert log == ["enter", "oracle", "reference", "exit", "synchronize",
                   "enter", "kernel", "exit", "synchronize", "judge", "hand over"]


def test_a_fault_that_poisons_the_context_raises_naming_the_kernel(stand_in_cuda, monkeypatch, caplog):
    log: list[str] = []
    monkeypatch.setattr(validation, "_check_stream", lambda device: _StandInStream(log, fault=2))
    _logged_xxt(monkeypatch, log)
    with caplog.at_level(logging.ERROR, logger="ds_canzona.kernels"):
        with pytest.raises(validation.DeviceFault) as raised:
            K.xxt(torch.randn(24, 40))
    message = str(raised.value)
    for piece in ("a device fault in the kernel", "syrk_kernel", "xxt", "[24, 40]", "illegal memory access",
                  "training cannot go on in this process", 'canzona.kernels: "torch"'):
        assert piece in message, (piece, message)
    assert "judge" not in log and log[-1] == "context lost?"
    assert message in [r.getMessage() for r in caplog.records]
    assert K.backend_status()["xxt"]["fallback"] is not None


def test_an_error_at_synchronisation_that_leaves_the_context_usable_is_a_failed_check(stand_in_cuda, monkeypatch,
                                                                                       caplog):
    log: list[str] = []
    monkeypatch.setattr(validation, "_check_stream", lambda device: _StandInStream(log, fault=2, lost=False))
    _logged_xxt(monkeypatch, log)
    x = torch.randn(24, 40)
    with caplog.at_level(logging.WARNING, logger="ds_canzona.kernels"):
        assert torch.equal(K.xxt(x), syrk_reference(x))
    (warning,) = _warnings(caplog)
    assert "syrk_kernel" in warning and "RuntimeError: CUDA error: an illegal memory access" in warning


def test_the_check_stream_does_nothing_off_cuda():
    stream = validation._CheckStream(torch.device("cpu"))
    assert stream.side is None and not stream.context_lost()
    with stream:
        t = torch.ones(2)
    stream.synchronize()
    stream.hand_over([t])
