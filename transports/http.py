"""A small HTTP/1.1 server for JSON APIs on trio, with server-sent events: h11 does the protocol.

For callers outside the actor system that speak HTTP (an agent using the OpenAI SDK). A handler
takes a :class:`Request` and returns a :class:`Response`: a JSON body, or ``events`` -- an async
iterator of JSON-able objects sent as ``text/event-stream`` (``data: {...}`` each, then
``data: [DONE]``). Connections are kept alive between requests. What a client gets wrong becomes
a JSON error with a 4xx status (a body that is not a JSON object: 400; a body over ``max_body``:
413; a head over ``MAX_HEAD_BYTES``: 431; a path no route takes: 404); a handler that raises
:class:`HTTPError` chooses its status, and any other exception is a 500 whose text names it, while
the server goes on.

A request must arrive whole within ``READ_TIMEOUT_S`` of the server starting to wait for it (a kept-alive
connection's wait included): a client that sends part of a request and then nothing (slow loris) is
answered 408 and hung up on, instead of holding a connection and a task forever. A connection that
fails in a way nobody foresaw is logged and closed; the server and its other connections go on.
With ``counters``, the server counts into it what an actor's Status reports: ``http_requests``,
``http_4xx``, ``http_5xx``, ``http_timeouts``, ``http_failed_connections``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import h11
import structlog
import trio

READ_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 16 << 10  # h11's own limit on an incomplete head


@dataclasses.dataclass
class Request:
    method: str
    path: str
    body: dict[str, Any]


@dataclasses.dataclass
class Response:
    body: Any = None
    status: int = 200
    events: AsyncIterator[Any] | None = None


class HTTPError(Exception):
    """Raised by a handler: answer with ``status`` and ``message`` (OpenAI's error shape)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


Handler = Callable[[Request], Awaitable[Response]]
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 408: b"Request Timeout", 409: b"Conflict",
            413: b"Content Too Large", 431: b"Request Header Fields Too Large", 500: b"Internal Server Error"}
_log = structlog.get_logger()


@dataclasses.dataclass
class _Served:
    """What one server shares with its connections."""

    handler: Handler
    max_body: int
    counters: collections.Counter[str]


async def serve(handler: Handler, host: str, port: int, *, max_body: int = 16 << 20,
                counters: collections.Counter[str] | None = None,
                task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; ``task_status.started`` gets the port (useful with ``port=0``)."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners[0].socket.getsockname()[1])
    served = _Served(handler, max_body, counters if counters is not None else collections.Counter())
    await trio.serve_listeners(lambda stream: _connection(stream, served), listeners)


async def _connection(stream: trio.SocketStream, served: _Served) -> None:
    """Serve one connection's requests; nothing a client does here may reach the listener's nursery."""
    try:
        await _exchanges(stream, h11.Connection(h11.SERVER), served)
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
        pass  # the client went away mid-exchange
    except Exception:  # a bug: this connection ends, the server goes on
        served.counters["http_failed_connections"] += 1
        _log.exception("an HTTP connection failed")
    finally:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.aclose()


async def _exchanges(stream: trio.SocketStream, connection: h11.Connection, served: _Served) -> None:
    counters = served.counters
    while True:
        try:
            with trio.fail_after(READ_TIMEOUT_S):
                request = await _read_request(stream, connection, served.max_body)
        except h11.RemoteProtocolError as err:  # not HTTP/1.1: say so if we still may, then hang up
            await _refuse(stream, connection, counters, _error(400, f"not an HTTP/1.1 request: {err}"))
            return
        except trio.TooSlowError:
            counters["http_timeouts"] += 1
            if connection.their_state is not h11.IDLE:  # part of a request came: say why we hang up
                await _refuse(stream, connection, counters, _error(408, f"the request did not arrive whole within "
                                                                        f"{READ_TIMEOUT_S:g} s"))
            return
        if request is None:
            return
        counters["http_requests"] += 1
        response = request if isinstance(request, Response) else await _answer(served.handler, request)
        counters[f"http_{response.status // 100}xx"] += 1
        if isinstance(request, Response):  # the request itself was wrong
            await _send(stream, connection, request)
        else:
            await _send_safely(stream, connection, response)
        if connection.our_state is not h11.DONE or connection.their_state is not h11.DONE:
            return  # a body left unread (too large), or either side asked to close
        connection.start_next_cycle()


async def _refuse(stream: trio.SocketStream, connection: h11.Connection, counters: collections.Counter[str],
                  response: Response) -> None:
    """Answer a request that cannot be read, if HTTP still lets us (before hanging up)."""
    counters["http_requests"] += 1
    counters[f"http_{response.status // 100}xx"] += 1
    if connection.our_state in (h11.IDLE, h11.SEND_RESPONSE):
        with trio.move_on_after(READ_TIMEOUT_S):  # a client that reads nothing does not hold us either
            await _send(stream, connection, response)


async def _send_safely(stream: trio.SocketStream, connection: h11.Connection, response: Response) -> None:
    """Send ``response``; if it cannot be (a body JSON cannot carry, an event stream that raised), a 500
    while nothing is sent yet, else the connection is closed: the server itself goes on."""
    try:
        await _send(stream, connection, response)
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
        raise
    except Exception as err:
        if connection.our_state is not h11.SEND_RESPONSE:
            raise h11.LocalProtocolError(f"a response failed half-way: {type(err).__name__}: {err}") from err
        await _send(stream, connection, _error(500, f"the answer could not be sent: {type(err).__name__}: {err}"))


async def _answer(handler: Handler, request: Request) -> Response:
    try:
        return await handler(request)
    except HTTPError as err:
        return _error(err.status, str(err))
    except Exception as err:  # a bug in a handler answers 500 and leaves the server serving
        _log.exception("a request's handler failed", method=request.method, path=request.path)
        return _error(500, f"{type(err).__name__}: {err}")


async def _read_request(stream: trio.SocketStream, connection: h11.Connection,
                        max_body: int) -> Request | Response | None:
    """The next request; an error Response when it cannot be taken; None when the client closed."""
    head: h11.Request | None = None
    body = bytearray()
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            if not data and head is None:
                return None
            connection.receive_data(data)
        elif isinstance(event, h11.Request):
            head = event
            size = len(head.target) + sum(len(name) + len(value) + 4 for name, value in head.headers)
            if size > MAX_HEAD_BYTES:  # h11 limits a head only while it is incomplete: one read may bring more
                return _error(431, f"the request's head is over {MAX_HEAD_BYTES} bytes")
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_body:
                return _error(413, f"the body is over {max_body} bytes")
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            break
        elif isinstance(event, h11.ConnectionClosed):
            return None
    parsed: Any = {}
    if body:
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError) as err:  # RecursionError: arrays nested thousands deep
            return _error(400, f"the body is not JSON: {err}")
    if not isinstance(parsed, dict):
        return _error(400, "the body must be a JSON object")
    return Request(head.method.decode(), head.target.decode().split("?", 1)[0], parsed)


def _error(status: int, message: str) -> Response:
    return Response({"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                               "code": status}}, status)


async def _send(stream: trio.SocketStream, connection: h11.Connection, response: Response) -> None:
    reason = _REASONS.get(response.status, b"")
    if response.events is None:
        data = json.dumps(response.body).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
        await _write(stream, connection, h11.Response(status_code=response.status, headers=headers, reason=reason))
        await _write(stream, connection, h11.Data(data=data))
    else:
        headers = [("content-type", "text/event-stream"), ("cache-control", "no-cache"),
                   ("transfer-encoding", "chunked")]
        await _write(stream, connection, h11.Response(status_code=response.status, headers=headers, reason=reason))
        try:
            async with contextlib.aclosing(response.events) as events:  # closed now if the client vanishes
                async for event in events:
                    await _write(stream, connection, h11.Data(data=f"data: {json.dumps(event)}\n\n".encode()))
        except HTTPError as err:  # mid-stream, the status is sent already: the error travels as an event
            await _write(stream, connection, h11.Data(data=f"data: {json.dumps(_error(err.status, str(err)).body)}"
                                                            "\n\n".encode()))
        await _write(stream, connection, h11.Data(data=b"data: [DONE]\n\n"))
    await _write(stream, connection, h11.EndOfMessage())


async def _write(stream: trio.SocketStream, connection: h11.Connection, event: Any) -> None:
    data = connection.send(event)
    if data:
        await stream.send_all(data)
