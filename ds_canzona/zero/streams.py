"""Stream order for the ZeRO runtimes: which stream runs what, and who waits for whom.

On CUDA a kernel is ordered only after the work queued earlier on its own stream. An
asynchronous NCCL collective runs on NCCL's stream after the work queued so far on the stream
that issued it, and ``work.wait()`` makes the stream that is current at that moment wait for its
end. Nothing else orders two streams, and backward does not run on one stream only: autograd runs a
post-accumulate-grad hook on the stream of the op that produced the gradient, and torch.compile
runs backward ops on streams of its own. So the runtimes state every order they rely on, through
this module, the way DeepSpeed's ZeRO-1/2 does with its ``reduction_stream``:

- a buffer's users: a stream about to use a gradient buffer first waits for the buffer's last
  user on another stream (``StreamOrder.use``), so every write into a bucket, and the zeroing of
  a fresh one, happens in one order whatever stream each hook ran on;
- each runtime has one side stream for its reductions: it waits for the buffer's last user,
  converts and divides, issues the collective, and waits for the collective's end itself
  (``StreamOrder.on_side``, ``StreamOrder.wait``). A backward hook never makes the compute
  stream wait for communication, and the host never waits;
- a buffer the side stream or a collective used is handed back to the caching allocator with
  ``record_stream`` on the side stream (``StreamOrder.keep_alive``): its memory is not given to
  another tensor before the side stream has passed that use;
- the same for a tensor of one stream read on another and dropped there (a gradient that arrived
  twice, on two streams, summed on the second: ``StreamOrder.read_here``);
- the compute stream waits for the side stream once, before the step reads what was reduced
  (``StreamOrder.compute_waits``), and the side stream waits for the compute stream once after
  the step, before it writes those buffers again (``StreamOrder.side_waits``);
- writes that a later reader on another stream needs (ZeRO-3 owners writing their shards before
  the next forward broadcasts them from DeepSpeed's all-gather stream) are marked by an event
  that the reader's stream waits for (``WriteMark``).

On a synchronised device (DeepSpeed's CPU accelerator: ``is_synchronized_device()``) every one of
these is a no-op and ``StreamOrder.wait`` is the plain ``work.wait()``: the gloo path runs exactly
as it would without this module.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager

import torch

from deepspeed.accelerator import get_accelerator

__all__ = ["StreamOrder", "WriteMark", "streams_are_real"]


def streams_are_real() -> bool:
    """Whether the accelerator's streams run concurrently (CUDA), so their order must be stated."""
    return not get_accelerator().is_synchronized_device()


class StreamOrder:
    """One runtime's side stream and the last user of each of its gradient buffers.

    Buffers are named by any hashable key the runtime chooses (a bucket index, a tensor index).
    """

    def __init__(self) -> None:
        self.ordered = streams_are_real()
        self.side = get_accelerator().Stream() if self.ordered else None
        self._last_user: dict[Hashable, object] = {}
        # The side stream has queued work the compute stream has not waited for yet.
        self._side_ahead = False

    def use(self, key: Hashable) -> None:
        """The current stream is about to use buffer ``key``: order it after the buffer's last user."""
        if not self.ordered:
            return
        stream = get_accelerator().current_stream()
        last = self._last_user.get(key)
        if last is not None and last != stream:
            stream.wait_stream(last)
        self._last_user[key] = stream

    def forget(self, key: Hashable) -> None:
        """Buffer ``key`` was released: its next allocation starts with no user."""
        self._last_user.pop(key, None)

    @contextmanager
    def on_side(self, *keys: Hashable) -> Iterator[None]:
        """Run the block on the side stream, after the last users of ``keys``; the side stream becomes their last user."""
        if not self.ordered:
            yield
            return
        for key in keys:
            last = self._last_user.get(key)
            if last is not None and last != self.side:
                self.side.wait_stream(last)
            self._last_user[key] = self.side
        self._side_ahead = True
        with get_accelerator().stream(self.side):
            yield

    def wait(self, work) -> None:
        """Wait for an asynchronous collective: the side stream waits, the compute stream and the host go on."""
        if not self.ordered:
            work.wait()
            return
        with get_accelerator().stream(self.side):
            work.wait()
        self._side_ahead = True

    def keep_alive(self, *tensors: torch.Tensor) -> None:
        """Tensors about to be dropped that the side stream (or a collective it waited for) used: the allocator
        reuses their memory only once the side stream has passed that use."""
        if not self.ordered:
            return
        for tensor in tensors:
            tensor.record_stream(self.side)

    def read_here(self, *tensors: torch.Tensor) -> None:
        """Tensors allocated on another stream, just read on the current one and about to be dropped: the allocator
        reuses their memory only once the current stream has passed that read (their own stream never waited for it)."""
        if not self.ordered:
            return
        stream = get_accelerator().current_stream()
        for tensor in tensors:
            tensor.record_stream(stream)

    def compute_waits(self) -> None:
        """The current (compute) stream waits for everything queued on the side stream, if anything was."""
        if self.ordered and self._side_ahead:
            stream = get_accelerator().current_stream()
            stream.wait_stream(self.side)
            self._side_ahead = False
            # Ordered after the side stream now, this stream may use those buffers without another wait.
            for key, last in self._last_user.items():
                if last == self.side:
                    self._last_user[key] = stream

    def side_waits(self) -> None:
        """The side stream waits for the current (compute) stream: its next writes come after the step's reads."""
        if self.ordered:
            self.side.wait_stream(get_accelerator().current_stream())


class WriteMark:
    """An event after some writes on one stream, for a reader on another stream to wait for."""

    def __init__(self) -> None:
        self.ordered = streams_are_real()
        self._event = None

    def record(self) -> None:
        """Mark the writes queued so far on the current stream."""
        if self.ordered:
            event = get_accelerator().Event()
            event.record(get_accelerator().current_stream())
            self._event = event

    def wait(self) -> None:
        """The current stream waits for the marked writes (nothing if none were marked)."""
        if self._event is not None:
            get_accelerator().current_stream().wait_event(self._event)
