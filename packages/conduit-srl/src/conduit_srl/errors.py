"""Typed errors of the SRL adapter (all subclasses of :class:`conduit.ConduitError`)."""

from __future__ import annotations

from typing import Any

from conduit.errors import CapacityError, ConduitError, ConfigurationError

__all__ = ["BufferFullError", "ZeroCopyStreamError", "SrlNotFoundError", "StreamClaimError", "UnstoredSamplesError",
           "ReceiveError", "SamplesLostWarning"]


class ZeroCopyStreamError(ConfigurationError):
    """A trainer asks for a Conduit buffer but its shared-memory stream is zero-copy.

    With ``SampleStream.Type.SHARED_MEMORY`` and ``buffer_zero_copy=True`` SRL's trainer ignores
    ``buffer_name`` and batches inside the shared-memory dock, so Conduit would never see the data.
    """


class SrlNotFoundError(ConfigurationError):
    """``install()`` found no SRL layout in this process (nothing was changed)."""


class StreamClaimError(ConfigurationError):
    """A sample stream marked ``conduit:`` cannot be carried by Conduit (e.g. a shared-memory stream)."""


class BufferFullError(CapacityError):
    """An on-policy buffer with ``on_full="raise"`` has no room for a put now, and only a delivery can make room.

    On-policy storage never evicts, so room comes only from ``get()`` delivering a rollout's last
    minibatch. With ``on_full="raise"`` a put never waits for that (on a host that puts and gets on one
    thread the wait could never end): it raises this at once. Nothing of the samples it names was stored;
    call ``get()`` (or ``empty()``, which drops rollouts too stale to deliver) until room is freed, then put
    them again, or raise ``capacity``. (``on_full="keep"`` never raises this: the buffer keeps such samples
    and stores them first once room is freed, for callers that cannot put a sample again, such as SRL's
    native ``consume_to``, which has taken it off its socket.)

    The buffer keeps nothing it refused, since a caller that puts the samples again (a claimed stream's
    consumer does) would store them twice; the error carries the put's sample instead. A caller that no
    longer holds it, such as SRL's native ``consume_to``, which took it off its socket, lets this error
    through with the sample in it: the host that meets the error puts ``sample`` again, and nothing is lost.

    Attributes:
        samples_stored: samples of the put taken before it was refused (a put that completed a rollout stores
            through that rollout's end first): put only the others again.
        sample: the sample the refused put was given, as given (of a batched ``[T, B, ...]`` one only the columns
            from ``samples_stored`` on were not stored: ``sample[:, samples_stored:]``).
    """

    sample: Any = None


class UnstoredSamplesError(ConduitError):
    """The buffer refused samples that had already been received (the buffer's error is the ``__cause__``).

    Raised by ``ConduitSampleConsumer.consume_to`` when the buffer's ``put`` raises part way through
    a coalesced message (or through samples ``consume()`` had left over), or refuses a message of one
    sample (``stored=0, total=1``), or receives a message whose coalescing header does not match its data
    (``stored=0, total=1``, a :class:`~conduit.SchemaError` cause, the message as received in ``samples``);
    not for :class:`BufferFullError`, whose refused samples the consumer keeps and puts first on its next
    ``consume_to``. The samples before the refused one are stored; the refused one and every later one of
    the message are attached here, so nothing received is lost without a trace. Messages not received yet
    stay with the transport.

    Attributes:
        stored: samples of the message the buffer stored before it refused.
        total: samples in the message.
        samples: the ``total - stored`` samples not stored, in order, each ``[T, ...]`` (``[T, B, ...]`` for a
            buffer with ``batched_puts=True``; of one that buffer stored in part, the columns it did not
            store): put them again once the cause is dealt with, or drop them knowingly.
        put_by_call: samples the raising ``consume_to`` call put into the buffer (earlier messages of
            the call and the ``stored`` ones of this one): what it would have returned.
    """

    def __init__(self, *, stored: int, total: int, samples: list[Any], cause: BaseException) -> None:
        super().__init__(f"The buffer refused a received message part way: {stored} of its {total} samples were "
                         f"stored, {len(samples)} were not ({type(cause).__name__}: {cause}). They are in this "
                         f"error's .samples; put them again once the cause is dealt with.")
        self.stored = stored
        self.total = total
        self.samples = samples
        self.put_by_call = stored



class ReceiveError(ConduitError):
    """The native consumer under a ``ConduitSampleConsumer`` raised while receiving (its error is the ``__cause__``).

    Raised by ``ConduitSampleConsumer.consume_to`` for an error of the transport it wraps, e.g. a received
    message whose bytes do not unpickle (from a foreign sender); a buffer's refusal is an
    :class:`UnstoredSamplesError` instead. The samples the call put before the error stay in the buffer, and are
    counted here; what the native consumer had taken off its socket when it raised is its own to report (SRL's
    drops a message it cannot unpickle, with a warning).

    Attributes:
        put_by_call: samples the raising ``consume_to`` call put into the buffer: what it would have returned.
    """

    def __init__(self, *, put_by_call: int, cause: BaseException) -> None:
        super().__init__(f"The sample stream's native consumer raised after this consume_to call put {put_by_call} "
                         f"samples into the buffer (they stay stored; .put_by_call counts them): "
                         f"{type(cause).__name__}: {cause}")
        self.put_by_call = put_by_call

class SamplesLostWarning(RuntimeWarning):
    """A Conduit sample producer or consumer was garbage-collected without ``close()`` while it held samples.

    A producer's samples posted and not sent yet, or a consumer's received samples that ``consume()``
    had not handed out, are lost then (no finalizer sends over the network from the garbage
    collector's thread). They are counted in :func:`conduit_srl.streams.lost_without_close`; close
    streams to send or get them instead.
    """
