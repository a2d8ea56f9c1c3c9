"""The kernel client the notebook runner talks through: jupyter_client's asyncio client, with its shell
channel's sends made through the asyncio socket so that they cannot swallow a reply's wake-up.

What it is: ``RunnerKernelClient``, which ``notebooks.run_notebook`` has papermill/nbclient use (by
configuration, ``AsyncKernelManager.client_class``). What it is not: a change to what is sent or
when; the messages are the same, only the socket call that writes them differs.

Why. nbclient waits for a cell's ``execute_reply`` by awaiting a poll on the shell socket. While it
waits, the same event loop handles the cell's IOPub messages, and nbclient's stand-in for a front
end's Output widget answers every output a cell shows inside an ``ipywidgets.Output`` with a
``comm_msg`` to the kernel, on that same shell socket (``nbclient/output_widget.py``, ``sync_state``).
Every explorer of ``fate_lab.study.widgets`` draws into an Output widget. jupyter_client's
``Session.send`` writes through a *blocking* shadow of the asyncio socket (``zmq.Socket.shadow``).
A blocking zmq send processes the socket's pending commands, which resets the socket's
edge-triggered ``ZMQ_FD``. When the reply has just arrived, that FD signal was its only wake-up:
the event loop never sees the shell socket become readable, and the reply sits in the socket until
the poll's timeout, the per-cell limit, runs out (the cell then completes, exactly that late). The
asyncio socket's own send does what the shadow skips: after an immediate send it re-checks the
socket's events and schedules the waiting poll (pyzmq PR #1208, for exactly this starvation).

Upstream: jupyter/nbclient#312 (a cell with widgets sometimes blocks) and #311, jupyter/jupyter_client
#1059 (drop the blocking shadow in ``Session.send``), all open when this was written.
"""
from __future__ import annotations

import asyncio

from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from traitlets import Type


class _AsyncioSend:
    """What ``Session.send`` writes to: the asyncio socket's own ``send_multipart``.

    Not a ``zmq.Socket``, so ``Session.send`` neither shadows it nor asks for tracking. pyzmq sends
    at once when the socket can take the message (a shell DEALER always can, short of its high-water
    mark) and queues it on the running loop otherwise; an error raised by an immediate send is
    raised here, as the blocking send would.
    """

    __slots__ = ("socket",)

    def __init__(self, socket):
        self.socket = socket

    def send_multipart(self, parts, **kwargs):
        future = self.socket.send_multipart(parts, **kwargs)
        if future.done():
            future.result()
        return future


class WakeSafeShellChannel(AsyncZMQSocketChannel):
    """The shell channel, sending through the asyncio socket while an event loop runs."""

    def send(self, msg: dict) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            # No loop runs, so nothing awaits this socket now (papermill asks for kernel_info this way
            # after the last cell), and a poll started later checks the socket's events first.
            super().send(msg)
            return
        assert self.socket is not None
        self.session.send(_AsyncioSend(self.socket), msg)


class RunnerKernelClient(AsyncKernelClient):
    """jupyter_client's asyncio kernel client with ``WakeSafeShellChannel`` as its shell channel."""

    shell_channel_class = Type(WakeSafeShellChannel)  # type: ignore[assignment]
