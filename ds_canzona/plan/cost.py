"""Cost models: how much optimizer work one tensor is.

A cost model is a small object with a ``name`` and one method, ``cost(spec) -> float``. Three kinds:

- ``numel``: the paper's linear model, W(p) = numel(p).
- ``flops``: floating-point operations of one optimizer step on that tensor, counted from the
  algorithm (matrix products as 2·m·n·k, elementwise ops one flop per element and operation).
  Matrices pay the matrix optimizer (Muon, Shampoo or SOAP); other tensors pay AdamW.
- ``roofline`` (the runtime's default): the same step priced by what bounds each part of it.
  Matrix products run at the device's matmul rate; elementwise passes (AdamW, momentum, the
  update) run at its memory bandwidth, so they cost ``machine_balance`` FLOPs per byte moved:

      cost = max(matmul FLOPs + max(elementwise FLOPs, machine_balance · elementwise bytes),
                 machine_balance · launch_bytes · kernel launches)

  FLOPs alone price an AdamW element at 15 operations against thousands for a Muon element, and
  a big embedding under AdamW then looks free; measured on one CPU thread, AdamW on a
  37984 x 1024 embedding takes 3.3x as long as Muon on a 1024 x 1024 matrix (docs/PLANNER.md).
  The second term is a floor per item: a step launches a fixed number of kernels whatever the
  tensor's size (Muon about 70 per matrix; AdamW 10 per tensor on the CPU, a share of a few
  multi-tensor launches on CUDA: ``adamw_launches``), each taking a launch latency, so a rank
  that owns thousands of norms is not free. ``launch_bytes`` is that latency in the model's unit:
  the elementwise bytes the device moves in the time of one launch (launch seconds x elementwise
  bytes/s), so that ``machine_balance · launch_bytes`` is one launch in matmul FLOPs. It is a
  floor, not a sum: on a GPU the host queues the next kernel while the device runs this one, so
  a step takes about the longer of its work and its launches.

The FLOP counts are exact for the algorithms as written in each docstring; what they do not model
is kernel efficiency (a small matrix runs further from peak than a big one), which matters little
for balance, since it is the big matrices that set the busiest rank.

A 3-D tensor is priced as ``shape[0]`` matrices of ``shape[1] x shape[2]`` (MoE experts, each
updated on its own), a per-head spec as ``heads`` matrices of ``rows / heads`` rows, and 4 or more
dims as one ``(shape[0], prod(shape[1:]))`` matrix (convolutions), as the optimizers update them
(``ParamSpec.matrix_stack``). A tensor-parallel shard costs its full matrix's work divided by ``tp_size``: its TP
group computes the full update once, on one host rank, so on average each member carries 1/tp_size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from .specs import ParamSpec, PlanError

__all__ = [
    "ADAMW_FLOPS_PER_ELEMENT",
    "ADAMW_LAUNCHES",
    "COST_MODELS",
    "DEFAULT_LAUNCH_BYTES",
    "DEFAULT_MACHINE_BALANCE",
    "CostModel",
    "FlopsCost",
    "NumelCost",
    "RooflineCost",
    "StepWork",
    "adamw_flops",
    "adamw_launches",
    "cost_model",
    "default_launch_bytes",
    "default_machine_balance",
    "muon_flops",
    "normuon_flops",
    "adamuon_flops",
    "newton_schulz_flops",
    "newton_schulz_launches",
    "optimizer_work",
    "shampoo_flops",
    "step_launches",
    "soap_flops",
]

# One AdamW step per element: m = b1*m + (1-b1)*g (3), v = b2*v + (1-b2)*g*g (4), two bias
# corrections (2), sqrt (1), + eps (1), divide (1), p -= lr*update (2), decoupled decay p *= 1-lr*wd (1).
ADAMW_FLOPS_PER_ELEMENT = 15

# Muon's elementwise work per element besides Newton-Schulz: momentum lerp (3), Nesterov lerp (3),
# Frobenius normalisation (square-add 2, divide 1), decay and scaled update (3).
_MUON_ELEMENTWISE_FLOPS = 12

# Elements read or written per tensor element by the elementwise passes of one step, as the
# per-tensor rules in ds_canzona.optim run them (each torch op reads its inputs and writes its
# output once). AdamW: lerp of m (3), g² (2), lerp of v (3), two bias corrections (2 + 2), sqrt
# (2), + eps (2), divide (3), decay (2), update (3).
ADAMW_ACCESSES_PER_ELEMENT = 24
# Muon outside Newton-Schulz: momentum lerp (3), Nesterov lerp (3), normalisation (norm 1,
# scale 2), decay (2), update (3).
_MUON_ACCESSES_PER_ELEMENT = 14
# NorMuon's and AdaMuon's passes after Newton-Schulz, per element (per-row terms left out):
# flops: NorMuon's O² and row mean (2) and divide (1); AdaMuon's O² (1), moment lerp (3), sqrt and
# + eps (2), divide (1) and sign (1); the rescale: N² and its sum (2), the product (1), and for
# "original" O's norm too (2). Accesses, each op reading its inputs and writing its output:
# NorMuon's O² (2), row mean (1), divide (2); AdaMuon's O² (2), lerp (3), sqrt (2), + eps (2),
# divide (3), sign (2); the rescale's N² (2), sum (1), product (2), and "original"'s O² and sum (3).
_NORMUON_FLOPS, _NORMUON_ACCESSES = 3, 5
_ADAMUON_FLOPS, _ADAMUON_ACCESSES = 7, 12
_SIGN_FLOPS, _SIGN_ACCESSES = 1, 2
_RESCALE_FLOPS = {"original": 5, "match_rms_adamw": 3}
_RESCALE_ACCESSES = {"original": 8, "match_rms_adamw": 5}
# Shampoo's grafting: AdamW's passes plus the two norms (2) and the rescale (2).
_SHAMPOO_ACCESSES_PER_ELEMENT = ADAMW_ACCESSES_PER_ELEMENT + 4
# A factor's EMA (lerp: read the factor and the new statistic, write the factor).
_EMA_ACCESSES = 3

# Bytes of one element of optimizer state and master weights (fp32).
STATE_ELEMENT_BYTES = 4

# Matmul FLOP/s over elementwise bytes/s, for the roofline model, per device kind. cpu: measured
# on the development machine with the per-tensor rules themselves (`python -m ds_canzona.bench
# calibrate`, one thread, fp32: Muon at 124-142 GFLOP/s, AdamW at 3.4-4.8 GB/s, balance 28-39).
# cuda: from H100/H200 datasheets (dense bf16 ~990 TFLOP/s; 3.35-4.8 TB/s HBM) with the matmul
# rate derated to what Newton-Schulz-sized products reach; not measured here. Calibrate on the
# real device and set canzona.machine_balance where it matters.
DEFAULT_MACHINE_BALANCE = {"cpu": 30.0, "cuda": 150.0}

# Kernel launches of one step, as the rules in ds_canzona.optim run them on their torch path (the
# CPU, and wherever the Triton kernels are off): every dispatched op that writes a tensor of one
# or more dims; views and the 0-dim step counter do not count (tests/test_plan_cost.py counts them
# from the rules). Weight decay is counted on (one launch). AdamW: lerp of m, g², lerp of v, two
# bias corrections, sqrt, + eps, divide, decay, update: ten operations, each one torch foreach op
# over the group of AdamW tensors a rank owns (ds_canzona.optim.adamw). How many kernels a foreach
# op launches depends on the device: the CPU has no multi-tensor kernels, and its foreach ops run
# the per-tensor op once per tensor (ADAMW_LAUNCHES per tensor); CUDA packs the whole list into
# few launches (_ADAMW_FOREACH_DEPTHS and adamw_launches).
ADAMW_LAUNCHES = 10
# The tensor lists each of those ten ops hands torch's multi_tensor_apply (its "depth": the lists
# read and written, an out-of-place op's output included), in the rule's order: lerp_ (m, g), mul
# (g, g, g²), lerp_ (v, g²), the two bias corrections as out-of-place scalar products (m, m̂ and
# v, v̂), sqrt_ (v̂), add_ of eps (v̂), div_ (m̂, v̂), the decay mul_ (p), the update add_ (p, m̂).
_ADAMW_FOREACH_DEPTHS = (2, 3, 2, 2, 2, 1, 1, 2, 1, 2)
# torch's multi_tensor_apply (aten/src/ATen/native/cuda/MultiTensorApply.cuh, torch 2.13) cuts
# every tensor into chunks of 65536 elements and launches one kernel whenever the launch holds
# depth_to_max_tensors[depth - 1] tensors or 320 chunks, and once more for what is left. Assumed:
# the tables of builds before CUDA 13 (kernel arguments limited to 4 KB): 110, 64 and 48 tensors
# at depths 1, 2 and 3. CUDA 13 builds take 32 KB of arguments and pack about 7x more (770, 448,
# 336 tensors, 2240 chunks); with those, launches per small tensor are a seventh of these.
_MTA_CHUNK_NUMEL = 65536
_MTA_MAX_CHUNKS = 320
_MTA_MAX_TENSORS = {1: 110, 2: 64, 3: 48}
# Muon per tensor: momentum lerp, Nesterov lerp, decay, update; per matrix: the Frobenius norm, its
# scale, + eps, the divide; one more to make a tall matrix's transpose contiguous, and for a stack
# of matrices one output allocation per tensor and one copy per matrix. Newton-Schulz: see
# newton_schulz_launches.
_MUON_TENSOR_LAUNCHES = 4
_MUON_MATRIX_LAUNCHES = 4
# NorMuon and AdaMuon (ds_canzona.optim.adaptive_muon) add to Muon's launches, once per tensor
# (each pass runs on the whole stack of its matrices): the second-moment normalisation (NorMuon:
# O², the row mean, the moment's lerp, sqrt, + eps, the divide: 6; AdaMuon: the same without the
# mean: 5, and the sign of the momentum: 1), and the rescale to a Frobenius norm (N², its sum and
# sqrt, + eps, the ratio, the product: 7 for "match_rms_adamw"; 9 for "original", which also takes
# the norm of O), and for a lone tall matrix the copy that makes it contiguous: 1. Counted from
# the rules in tests/test_plan_cost.py.
_NORMUON_NORMALISE_LAUNCHES, _ADAMUON_NORMALISE_LAUNCHES, _SIGN_LAUNCHES = 6, 5, 1
_RESCALE_LAUNCHES = {"original": 9, "match_rms_adamw": 7}
# Shampoo per step: per tensor AdamW's grafting direction, the output and the update (12); per block
# a×b of each matrix (each expert of a stack) the two statistics, the two preconditioner products
# and the rescale (15), one more copy to make the block contiguous when it leaves out columns (cols
# above max_preconditioner_dim), and the inverse roots' refresh (18 per block every
# precondition_frequency steps). SOAP: per tensor the first moment, the decay and the update (3), and
# for a stack one copy joining the experts' directions; per matrix Adam in its rotated basis (7), per
# rotated side its statistic and rotations (left 6, right 7: one more copy, the contiguous Gᵀ), and
# the eigenbasis refresh (10 per rotated side every precondition_frequency steps).
_SHAMPOO_LAUNCHES, _SHAMPOO_BLOCK_LAUNCHES, _SHAMPOO_REFRESH_LAUNCHES = 12, 15, 18
_SHAMPOO_PARTIAL_BLOCK_LAUNCHES = 1
_SOAP_LAUNCHES, _SOAP_STACK_LAUNCHES, _SOAP_MATRIX_LAUNCHES, _SOAP_REFRESH_LAUNCHES = 3, 1, 7, 10
_SOAP_SIDE_LAUNCHES = {"left": 6, "right": 7}
# Both, on each refresh: the statistics guard (optim/shampoo.py statistic_health) looks at every
# statistic of the tensor, every expert's of a stack (one launch each), and reads them as one
# stacked vector (one launch per tensor).
_GUARD_TENSOR_LAUNCHES, _GUARD_STAT_LAUNCHES = 1, 1

# One kernel launch in elementwise bytes (launch seconds x elementwise bytes/s), per device kind.
# cpu: measured on the shared development machine (`python -m ds_canzona.bench calibrate`, one
# thread, load average 5-10: a tiny in-place add took 4.7-9.3 us at 1.7-3.0 GB/s of AdamW traffic,
# 0.8e4-2.1e4 bytes over six runs; both rates slow down together under load). cuda: not measured
# here; about 5 us of host time per eager PyTorch op at about 3 TB/s of HBM bandwidth (H100/H200
# datasheets: 3.35-4.8 TB/s). Calibrate on the real device where it matters.
DEFAULT_LAUNCH_BYTES = {"cpu": 1.5e4, "cuda": 1.5e7}

# Symmetric eigendecomposition with eigenvectors (tridiagonalisation plus implicit QR), about
# 9·k^3 flops (Golub & Van Loan, Matrix Computations, Table 8.3.1 gives ~9n^3 for Q and Lambda).
_EIGH_FLOPS_COEFF = 9.0
# Householder QR of a k x k matrix: (4/3)·k^3.
_QR_FLOPS_COEFF = 4.0 / 3.0


@runtime_checkable
class CostModel(Protocol):
    """What the planners need: a name for the plan, and a cost per tensor."""

    @property
    def name(self) -> str: ...

    @property
    def label(self) -> str: ...

    def cost(self, spec: ParamSpec) -> float: ...


def adamw_flops(numel: int) -> float:
    """AdamW step on ``numel`` elements: ``ADAMW_FLOPS_PER_ELEMENT · numel`` (15 flops per element)."""
    return float(ADAMW_FLOPS_PER_ELEMENT * numel)


def newton_schulz_flops(rows: int, cols: int, *, steps: int = 5, method: str = "gram") -> float:
    """Flops of ``steps`` quintic Newton-Schulz iterations on a ``rows x cols`` matrix.

    Let n = min(rows, cols) and m = max(rows, cols); the iteration runs on the n x m orientation.

    ``standard``, per step: A = X Xᵀ (2n²m), B = bA + cA² (2n³ + 3n²), X = aX + BX (2n²m + 2nm):
        steps · (4n²m + 2n³ + 3n² + 2nm).

    ``gram`` (iterates on the n x n Gram matrix R = X Xᵀ and applies the accumulated polynomial
    Q to X at the end, with a restart at step 2 that re-forms X = QX and R = XXᵀ for stability):
        R = XXᵀ (2n²m), then per step Z = bR + cR² (2n³ + 3n²); Q = Z + aI on the first step after
        a (re)start (n), else Q = aQ + ZQ (2n³ + 2n²); R = a(aR + ZR) + Z(aR + ZR) (4n³ + 4n²)
        except on the last step and just before the restart; the restart costs QX and XXᵀ (4n²m);
        the final X = QX (2n²m). For 5 steps: 8n²m + 28n³ + O(n²), against 20n²m + 10n³ for
        ``standard``: about 1.6x fewer flops at the aspect ratio 5 of an MLP weight.
        A square matrix (m == n) gains nothing from the Gram form and runs ``standard``.
    """
    if method not in ("gram", "standard"):
        raise PlanError(f"Invalid ns_method={method!r}: must be 'gram' or 'standard'.")
    n, m = min(rows, cols), max(rows, cols)
    if method == "standard" or m == n:
        return float(steps * (4 * n * n * m + 2 * n**3 + 3 * n * n + 2 * n * m))
    restart_at = 2
    flops = 2 * n * n * m
    fresh_q = True
    for step in range(steps):
        if step == restart_at:
            flops += 4 * n * n * m
            fresh_q = True
        flops += 2 * n**3 + 3 * n * n
        if fresh_q:
            flops += n
            fresh_q = False
        else:
            flops += 2 * n**3 + 2 * n * n
        if step < steps - 1 and step + 1 != restart_at:
            flops += 4 * n**3 + 4 * n * n
    flops += 2 * n * n * m
    return float(flops)


def newton_schulz_launches(rows: int, cols: int, *, steps: int = 5, method: str = "gram") -> int:
    """Kernel launches of ``steps`` Newton-Schulz iterations on a ``rows x cols`` matrix (torch path).

    ``standard``: per step A = XXᵀ, AA, bA, cA², their sum, BX, aX and the sum: 8.
    ``gram`` (restart at step 2, as :func:`newton_schulz_flops`): R = XXᵀ (4: the product and its
    mirrored triangles); per step Z = bR + cR² (4) and Q (3: aI + Z after a (re)start, else
    aQ + ZQ), then R's update aR + ZR and a(·) + Z(·) (6) except on the last step and just before
    the restart; the restart's QX and XXᵀ (5); the final QX (1). A square matrix runs ``standard``.
    """
    if method not in ("gram", "standard"):
        raise PlanError(f"Invalid ns_method={method!r}: must be 'gram' or 'standard'.")
    if method == "standard" or rows == cols:
        return 8 * steps
    restart_at = 2
    launches = 4 + 1
    for step in range(steps):
        if step == restart_at:
            launches += 5
        launches += 7
        if step < steps - 1 and step + 1 != restart_at:
            launches += 6
    return launches


def adamw_launches(numel: int, device: str = "cuda") -> float:
    """Kernel launches one AdamW step on a tensor of ``numel`` elements takes, as its share of a foreach group.

    ``device`` "cpu": ``ADAMW_LAUNCHES``, one per operation (the CPU runs a foreach op tensor by
    tensor). Any other device is taken to be CUDA: per operation, the tensor's share of torch's
    multi-tensor launches (see ``_MTA_MAX_TENSORS``), the larger of one slot of a launch's tensors
    and its chunks over a launch's chunks. The share is of a full launch: a rank's group of many
    small tensors fills its launches but the last; a group of one tensor still takes a whole
    launch per operation, which this does not charge, since the planner prices each tensor alone.
    """
    if device == "cpu":
        return float(ADAMW_LAUNCHES)
    chunks = -(-numel // _MTA_CHUNK_NUMEL)
    return sum(max(1.0 / _MTA_MAX_TENSORS[depth], chunks / _MTA_MAX_CHUNKS) for depth in _ADAMW_FOREACH_DEPTHS)


def step_launches(spec: ParamSpec, optimizer: str = "muon", *, device: str = "cuda", **options: Any) -> float:
    """Kernel launches of one step on ``spec``: ``optimizer`` for a matrix, AdamW otherwise.

    Shampoo's and SOAP's refreshes are amortised over ``precondition_frequency``; a TP shard
    carries 1/tp_size of its matrix's launches, as of its work. The counts are in the constants
    above; every launch costs the same, ``launch_bytes``, in :meth:`StepWork.roofline`. ``device``
    matters for AdamW alone (:func:`adamw_launches`): the matrix rules launch per tensor everywhere.
    """
    if not spec.matrix:
        return adamw_launches(spec.numel, device)
    merged = {**_OPTIMIZER_DEFAULTS[optimizer], **options}
    count, rows, cols = _matrix_stack(spec.matrix_stack)
    if optimizer == "muon":
        per_matrix = _MUON_MATRIX_LAUNCHES + (rows > cols) + newton_schulz_launches(
            rows, cols, steps=merged["ns_steps"], method=merged["ns_method"])
        launches = _MUON_TENSOR_LAUNCHES + count * per_matrix + (1 + count if count > 1 else 0)
    elif optimizer in ("normuon", "adamuon"):
        # A lone tall matrix comes back from Newton-Schulz transposed; the rule copies it contiguous
        # (one launch) so that its reductions add in the order they do for an expert of a stack.
        launches = step_launches(spec, "muon", ns_steps=merged["ns_steps"], ns_method=merged["ns_method"]) \
            * spec.tp_size + _normalisation_launches(optimizer, merged) + (count == 1 and rows > cols)
    elif optimizer == "shampoo":
        # Per matrix of the stack (each expert is blocked on its own); the guard reads once per tensor.
        max_dim, frequency = merged["max_preconditioner_dim"], merged["precondition_frequency"]
        blocks = sum(a_count for _, a_count in _blocks(rows, max_dim)) * sum(
            b_count for _, b_count in _blocks(cols, max_dim))
        per_block = (_SHAMPOO_BLOCK_LAUNCHES + (_SHAMPOO_PARTIAL_BLOCK_LAUNCHES if cols > max_dim else 0)
                     + (_SHAMPOO_REFRESH_LAUNCHES + 2 * _GUARD_STAT_LAUNCHES) / frequency)  # a left and a right statistic
        launches = _SHAMPOO_LAUNCHES + count * blocks * per_block + _GUARD_TENSOR_LAUNCHES / frequency
    else:
        max_dim, frequency = merged["max_preconditioner_dim"], merged["precondition_frequency"]
        rotated = [side for side, size in (("left", rows), ("right", cols)) if size <= max_dim]
        per_matrix = _SOAP_MATRIX_LAUNCHES + sum(
            _SOAP_SIDE_LAUNCHES[side] + (_SOAP_REFRESH_LAUNCHES + _GUARD_STAT_LAUNCHES) / frequency for side in rotated)
        guard = _GUARD_TENSOR_LAUNCHES / frequency if rotated else 0  # no statistic, no guard
        launches = _SOAP_LAUNCHES + (_SOAP_STACK_LAUNCHES if count > 1 else 0) + count * per_matrix + guard
    return launches / spec.tp_size


def muon_flops(shape: tuple[int, ...], *, ns_steps: int = 5, ns_method: str = "gram") -> float:
    """One Muon step on a matrix: Newton-Schulz plus 12 elementwise flops per element.

    The elementwise part is the momentum and Nesterov lerps (6), the Frobenius normalisation
    before the iteration (3) and the decayed, scaled update (3); see :func:`newton_schulz_flops`.
    """
    return _muon_work(shape, ns_steps=ns_steps, ns_method=ns_method).flops


def shampoo_flops(
    shape: tuple[int, ...], *, precondition_frequency: int = 100, max_preconditioner_dim: int = 1024
) -> float:
    """One Shampoo step on a matrix, with the inverse roots amortised over their refresh interval.

    The matrix is cut into blocks of at most ``max_preconditioner_dim`` along each dim (as
    distributed Shampoo does); each a x b block keeps a left (a x a) and right (b x b) factor:

    - statistics L += GGᵀ, R += GᵀG, as EMAs: 2a²b + 3a² + 2ab² + 3b²;
    - preconditioning L^(-1/4) G R^(-1/4): 2a²b + 2ab²;
    - inverse 4th roots by eigendecomposition, every ``precondition_frequency`` steps, per factor of
      size k: 9k³ (eigh) + 2k³ + k² (Q·diag·Qᵀ), i.e. (11(a³ + b³) + a² + b²) / frequency;
    - Adam grafting and the update: 15 flops per element (AdamW's count) plus 5 for the two
      Frobenius norms and the rescale.
    """
    return _shampoo_work(shape, precondition_frequency=precondition_frequency,
                         max_preconditioner_dim=max_preconditioner_dim).flops


def soap_flops(
    shape: tuple[int, ...], *, precondition_frequency: int = 10, max_preconditioner_dim: int = 10000
) -> float:
    """One SOAP step on a matrix (Adam in the eigenbasis of Shampoo's factors), amortised.

    Following the SOAP reference, a side longer than ``max_preconditioner_dim`` is not rotated
    (its basis is the identity and it keeps no factor). For rotated sides of size a (left) and b
    (right), one rotation Q_Lᵀ X Q_R costs 2a²b + 2ab² (only the rotated terms):

    - statistics L += GGᵀ, R += GᵀG, as EMAs: 2a²b + 3a² + 2ab² + 3b²;
    - three rotations: the gradient and the first moment into the basis, the update back out;
    - Adam in the rotated basis: 15 flops per element;
    - eigenbasis refresh every ``precondition_frequency`` steps, per factor of size k: one power
      step LQ (2k³), the eigenvalue estimate diag(Qᵀ(LQ)) (2k³) and a QR ((4/3)k³); plus rotating
      the second moment to the new order (a·b), i.e. ((16/3)(a³ + b³) + ab) / frequency.
    """
    return _soap_work(shape, precondition_frequency=precondition_frequency,
                      max_preconditioner_dim=max_preconditioner_dim).flops


@dataclass(frozen=True)
class StepWork:
    """One optimizer step on one tensor, split by what bounds each part's speed."""

    matmul_flops: float
    """Matrix products and factorisations (Newton-Schulz, statistics, rotations, roots): compute-bound."""
    elementwise_flops: float
    """Elementwise arithmetic (moments, normalisation, the update)."""
    elementwise_accesses: float
    """Elements read or written by the elementwise passes: memory-bound."""
    launches: float = 0.0
    """Kernel launches (:func:`step_launches`): each takes a latency, however small the tensor."""

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.elementwise_flops

    def roofline(self, machine_balance: float, element_bytes: int = STATE_ELEMENT_BYTES,
                 launch_bytes: float = 0.0) -> float:
        """FLOPs at the matmul rate that this step takes: elementwise passes charged for their bytes,
        and never less than its launches, each worth ``launch_bytes`` of elementwise traffic."""
        memory = machine_balance * element_bytes * self.elementwise_accesses
        work = self.matmul_flops + max(self.elementwise_flops, memory)
        return max(work, machine_balance * launch_bytes * self.launches)


def _adamw_work(numel: int, device: str) -> StepWork:
    return StepWork(0.0, adamw_flops(numel), float(ADAMW_ACCESSES_PER_ELEMENT * numel), adamw_launches(numel, device))


def _muon_work(shape: tuple[int, ...], *, ns_steps: int = 5, ns_method: str = "gram") -> StepWork:
    count, rows, cols = _matrix_stack(shape)
    return _times(count, StepWork(newton_schulz_flops(rows, cols, steps=ns_steps, method=ns_method),
                                  float(_MUON_ELEMENTWISE_FLOPS * rows * cols),
                                  float(_MUON_ACCESSES_PER_ELEMENT * rows * cols)))


def _normalisation_launches(optimizer: str, options: dict[str, Any]) -> int:
    """NorMuon's or AdaMuon's launches on top of Muon's, per tensor (see the constants above)."""
    if optimizer == "normuon":
        normalise = _NORMUON_NORMALISE_LAUNCHES
    else:
        normalise = _ADAMUON_NORMALISE_LAUNCHES + (_SIGN_LAUNCHES if options["sign_momentum"] else 0)
    return normalise + _RESCALE_LAUNCHES[options["lr_scaling"]]


def _normalised_muon_work(optimizer: str, shape: tuple[int, ...], *, ns_steps: int, ns_method: str,
                          lr_scaling: str, sign_momentum: bool = False) -> StepWork:
    """Muon's work plus the second-moment normalisation and the rescale (NorMuon, AdaMuon)."""
    muon = _muon_work(shape, ns_steps=ns_steps, ns_method=ns_method)
    count, rows, cols = _matrix_stack(shape)
    numel = count * rows * cols
    if optimizer == "normuon":
        flops, accesses = _NORMUON_FLOPS, _NORMUON_ACCESSES
    else:
        flops, accesses = _ADAMUON_FLOPS, _ADAMUON_ACCESSES
        if sign_momentum:
            flops, accesses = flops + _SIGN_FLOPS, accesses + _SIGN_ACCESSES
    flops += _RESCALE_FLOPS[lr_scaling]
    accesses += _RESCALE_ACCESSES[lr_scaling]
    return StepWork(muon.matmul_flops, muon.elementwise_flops + float(flops * numel),
                    muon.elementwise_accesses + float(accesses * numel))


def _normuon_work(shape: tuple[int, ...], *, ns_steps: int = 5, ns_method: str = "gram",
                  lr_scaling: str = "original") -> StepWork:
    return _normalised_muon_work("normuon", shape, ns_steps=ns_steps, ns_method=ns_method, lr_scaling=lr_scaling)


def _adamuon_work(shape: tuple[int, ...], *, ns_steps: int = 5, ns_method: str = "gram",
                  lr_scaling: str = "match_rms_adamw", sign_momentum: bool = True) -> StepWork:
    return _normalised_muon_work("adamuon", shape, ns_steps=ns_steps, ns_method=ns_method, lr_scaling=lr_scaling,
                                 sign_momentum=sign_momentum)


def normuon_flops(shape: tuple[int, ...], *, ns_steps: int = 5, ns_method: str = "gram",
                  lr_scaling: str = "original") -> float:
    """One NorMuon step on a matrix: Muon's plus the per-row normalisation and the rescale."""
    return _normuon_work(shape, ns_steps=ns_steps, ns_method=ns_method, lr_scaling=lr_scaling).flops


def adamuon_flops(shape: tuple[int, ...], *, ns_steps: int = 5, ns_method: str = "gram",
                  lr_scaling: str = "match_rms_adamw", sign_momentum: bool = True) -> float:
    """One AdaMuon step on a matrix: Muon's plus the sign, the element-wise normalisation and the rescale."""
    return _adamuon_work(shape, ns_steps=ns_steps, ns_method=ns_method, lr_scaling=lr_scaling,
                         sign_momentum=sign_momentum).flops


def _shampoo_work(shape: tuple[int, ...], *, precondition_frequency: int = 100,
                  max_preconditioner_dim: int = 1024) -> StepWork:
    count, rows, cols = _matrix_stack(shape)
    matmul = elementwise = accesses = 0.0
    for a, a_count in _blocks(rows, max_preconditioner_dim):
        for b, b_count in _blocks(cols, max_preconditioner_dim):
            blocks = a_count * b_count
            products = 2 * a * a * b + 2 * a * b * b  # statistics GGᵀ and GᵀG
            products += 2 * a * a * b + 2 * a * b * b  # L^(-1/4) G R^(-1/4)
            # eigh, then Q·diag·Qᵀ (2k³), for each factor, every precondition_frequency steps
            products += (_EIGH_FLOPS_COEFF + 2) * (a**3 + b**3) / precondition_frequency
            matmul += blocks * products
            elementwise += blocks * (3 * a * a + 3 * b * b + (a * a + b * b) / precondition_frequency
                                     + (ADAMW_FLOPS_PER_ELEMENT + 5) * a * b)
            accesses += blocks * (_EMA_ACCESSES * (a * a + b * b) + _SHAMPOO_ACCESSES_PER_ELEMENT * a * b)
    return _times(count, StepWork(matmul, elementwise, accesses))


def _soap_work(shape: tuple[int, ...], *, precondition_frequency: int = 10,
               max_preconditioner_dim: int = 10000) -> StepWork:
    count, rows, cols = _matrix_stack(shape)
    a = rows if rows <= max_preconditioner_dim else 0
    b = cols if cols <= max_preconditioner_dim else 0
    rotation = 2 * a * a * cols + 2 * rows * b * b
    matmul = 2 * a * a * cols + 2 * rows * b * b + 3 * rotation
    matmul += (4.0 + _QR_FLOPS_COEFF) * (a**3 + b**3) / precondition_frequency
    elementwise = 3 * a * a + 3 * b * b + ADAMW_FLOPS_PER_ELEMENT * rows * cols + rows * cols / precondition_frequency
    accesses = (_EMA_ACCESSES * (a * a + b * b) + ADAMW_ACCESSES_PER_ELEMENT * rows * cols
                + 2 * rows * cols / precondition_frequency)
    return _times(count, StepWork(float(matmul), float(elementwise), float(accesses)))


_OPTIMIZER_WORK: dict[str, Callable[..., StepWork]] = {"muon": _muon_work, "shampoo": _shampoo_work,
                                                        "soap": _soap_work, "normuon": _normuon_work,
                                                        "adamuon": _adamuon_work}


def optimizer_work(spec: ParamSpec, optimizer: str = "muon", *, device: str = "cuda", **options: Any) -> StepWork:
    """The work of one step on ``spec``: ``optimizer`` for a matrix, AdamW otherwise (TP: 1/tp_size each).

    ``device`` ("cpu", "cuda", ...) sets how AdamW's foreach operations launch (:func:`adamw_launches`).
    """
    if not spec.matrix:
        return _adamw_work(spec.numel, device)
    work = _OPTIMIZER_WORK[optimizer](spec.matrix_stack, **options)
    return StepWork(work.matmul_flops / spec.tp_size, work.elementwise_flops / spec.tp_size,
                    work.elementwise_accesses / spec.tp_size, step_launches(spec, optimizer, **options))


@dataclass(frozen=True, kw_only=True)
class NumelCost:
    """The paper's cost model: W(p) = numel(p), the same for matrices and the rest."""

    name: ClassVar[str] = "numel"

    @property
    def label(self) -> str:
        return "numel"

    def cost(self, spec: ParamSpec) -> float:
        return float(spec.numel)


_OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    "muon": {"ns_steps": 5, "ns_method": "gram"},
    "shampoo": {"precondition_frequency": 100, "max_preconditioner_dim": 1024},
    "soap": {"precondition_frequency": 10, "max_preconditioner_dim": 10000},
    "normuon": {"ns_steps": 5, "ns_method": "gram", "lr_scaling": "original"},
    "adamuon": {"ns_steps": 5, "ns_method": "gram", "lr_scaling": "match_rms_adamw", "sign_momentum": True},
}
_OPTIMIZER_FLOPS: dict[str, Callable[..., float]] = {"muon": muon_flops, "shampoo": shampoo_flops, "soap": soap_flops,
                                                     "normuon": normuon_flops, "adamuon": adamuon_flops}


@dataclass(frozen=True, kw_only=True)
class FlopsCost:
    """Flops of one step: the matrix optimizer's for matrices, AdamW's for the rest."""

    optimizer: str = "muon"
    options: tuple[tuple[str, Any], ...] = ()
    name: ClassVar[str] = "flops"

    def __post_init__(self) -> None:
        if self.optimizer not in _OPTIMIZER_DEFAULTS:
            raise PlanError(f"Invalid optimizer={self.optimizer!r}: must be one of {sorted(_OPTIMIZER_DEFAULTS)}.")
        allowed = _OPTIMIZER_DEFAULTS[self.optimizer]
        merged = dict(allowed)
        for key, value in self.options:
            if key not in allowed:
                raise PlanError(
                    f"Invalid option {key!r} for the {self.optimizer} cost model: expected one of {sorted(allowed)}."
                )
            merged[key] = value
        for key in ("ns_steps", "precondition_frequency", "max_preconditioner_dim"):
            if key in merged and (not isinstance(merged[key], int) or merged[key] < 1):
                raise PlanError(f"Invalid {key}={merged[key]!r}: must be an int >= 1.")
        if "ns_method" in merged and merged["ns_method"] not in ("gram", "standard"):
            raise PlanError(f"Invalid ns_method={merged['ns_method']!r}: must be 'gram' or 'standard'.")
        if "lr_scaling" in merged and merged["lr_scaling"] not in _RESCALE_LAUNCHES:
            raise PlanError(f"Invalid lr_scaling={merged['lr_scaling']!r}: must be one of {sorted(_RESCALE_LAUNCHES)}.")
        if "sign_momentum" in merged and not isinstance(merged["sign_momentum"], bool):
            raise PlanError(f"Invalid sign_momentum={merged['sign_momentum']!r}: must be True or False.")
        object.__setattr__(self, "options", tuple(sorted(merged.items())))

    @property
    def label(self) -> str:
        settings = ",".join(f"{key}={value}" for key, value in self.options)
        return f"flops:{self.optimizer}({settings})"

    def cost(self, spec: ParamSpec) -> float:
        if not spec.matrix:
            return adamw_flops(spec.numel)
        flops = _OPTIMIZER_FLOPS[self.optimizer](spec.matrix_stack, **dict(self.options))
        return flops / spec.tp_size


@dataclass(frozen=True, kw_only=True)
class RooflineCost(FlopsCost):
    """One step's time in matmul FLOPs: elementwise passes charged ``machine_balance`` FLOPs per byte."""

    machine_balance: float = DEFAULT_MACHINE_BALANCE["cuda"]
    launch_bytes: float = DEFAULT_LAUNCH_BYTES["cuda"]
    # The device kind the step runs on: how AdamW's foreach operations launch (adamw_launches).
    device: str = "cuda"
    name: ClassVar[str] = "roofline"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.device, str) or not self.device:
            raise PlanError(f"Invalid device={self.device!r}: must be a device kind such as 'cpu' or 'cuda'.")
        if isinstance(self.machine_balance, bool) or not isinstance(self.machine_balance, (int, float)) \
                or not math.isfinite(self.machine_balance) or self.machine_balance <= 0:
            raise PlanError(f"Invalid machine_balance={self.machine_balance!r}: must be a finite number > 0 "
                            "(matmul FLOP/s over elementwise bytes/s).")
        if isinstance(self.launch_bytes, bool) or not isinstance(self.launch_bytes, (int, float)) \
                or not math.isfinite(self.launch_bytes) or self.launch_bytes < 0:
            raise PlanError(f"Invalid launch_bytes={self.launch_bytes!r}: must be a finite number >= 0 "
                            "(one kernel launch in elementwise bytes: launch seconds x elementwise bytes/s; "
                            "0 turns the launch floor off).")
        object.__setattr__(self, "machine_balance", float(self.machine_balance))
        object.__setattr__(self, "launch_bytes", float(self.launch_bytes))

    @property
    def label(self) -> str:
        # machine_balance stays last: tools read the label's end for it.
        settings = ",".join(f"{key}={value}" for key, value in self.options)
        return (f"roofline:{self.optimizer}({settings},device={self.device},launch_bytes={self.launch_bytes:g},"
                f"machine_balance={self.machine_balance:g})")

    def cost(self, spec: ParamSpec) -> float:
        return optimizer_work(spec, self.optimizer, device=self.device, **dict(self.options)).roofline(
            self.machine_balance, launch_bytes=self.launch_bytes)


COST_MODELS = ("roofline", "flops", "numel")


def default_machine_balance(device: str) -> float:
    """The roofline model's default balance for a device kind ("cpu", "cuda", ...): GPUs share one value."""
    return DEFAULT_MACHINE_BALANCE.get(device, DEFAULT_MACHINE_BALANCE["cuda"])


def default_launch_bytes(device: str) -> float:
    """The roofline model's default launch floor for a device kind: one launch in elementwise bytes."""
    return DEFAULT_LAUNCH_BYTES.get(device, DEFAULT_LAUNCH_BYTES["cuda"])


def cost_model(name: str = "flops", optimizer: str = "muon", *, machine_balance: float | None = None,
               launch_bytes: float | None = None, device: str | None = None, **options: Any) -> CostModel:
    """Build a cost model: ``numel``, ``flops`` or ``roofline`` of ``optimizer`` with its options.

    Options: Muon ``ns_steps`` (5), ``ns_method`` ("gram" or "standard"); NorMuon and AdaMuon
    Muon's and ``lr_scaling`` ("original" / "match_rms_adamw"), AdaMuon ``sign_momentum`` (True); Shampoo and SOAP
    ``precondition_frequency`` (100 / 10) and ``max_preconditioner_dim`` (1024 / 10000).
    Roofline only: ``device``, the device kind the step runs on (default "cuda"; it sets how AdamW's
    foreach operations launch, and the two defaults that follow), ``machine_balance``, matmul
    FLOP/s over elementwise bytes/s of the device (default: ``default_machine_balance(device)``),
    and ``launch_bytes``, one kernel launch in elementwise bytes (default:
    ``default_launch_bytes(device)``; 0: no launch floor).
    """
    for key, value in (("machine_balance", machine_balance), ("launch_bytes", launch_bytes), ("device", device)):
        if name != "roofline" and value is not None:
            raise PlanError(f"{key} applies to the roofline cost model only, not {name!r}.")
    if name == "numel":
        if options:
            raise PlanError(f"The numel cost model takes no options, got {sorted(options)}.")
        return NumelCost()
    if name == "flops":
        return FlopsCost(optimizer=optimizer, options=tuple(sorted(options.items())))
    if name == "roofline":
        kind = "cuda" if device is None else device
        balance = default_machine_balance(kind) if machine_balance is None else machine_balance
        launch = default_launch_bytes(kind) if launch_bytes is None else launch_bytes
        return RooflineCost(optimizer=optimizer, options=tuple(sorted(options.items())), machine_balance=balance,
                            launch_bytes=launch, device=kind)
    raise PlanError(f"Invalid cost model name={name!r}: must be one of {', '.join(map(repr, COST_MODELS))}.")


def _matrix_stack(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(count, rows, cols): a 3-D shape is a stack of matrices, 2 or >= 4 dims one (shape[0], rest) matrix."""
    if len(shape) < 2:
        raise PlanError(f"A matrix optimizer needs a tensor with 2 or more dims, got shape {shape}.")
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    return 1, shape[0], math.prod(shape[1:])


def _times(count: int, work: StepWork) -> StepWork:
    """The work of ``count`` independent matrices of the same shape."""
    if count == 1:
        return work
    return StepWork(count * work.matmul_flops, count * work.elementwise_flops, count * work.elementwise_accesses)


def _blocks(size: int, max_dim: int) -> list[tuple[int, int]]:
    """(block size, how many) pairs covering ``size`` in blocks of at most ``max_dim``."""
    full, rest = divmod(size, max_dim)
    blocks = [(max_dim, full)] if full else []
    if rest:
        blocks.append((rest, 1))
    return blocks
