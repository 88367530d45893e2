"""The client commands (``mesh send``, ``tasks``, ``result``, ``cancel``, ``capacity``) and
how an error a user can cause reads: one line naming the fix.

**Errors.** A server that is not there, one that refuses (401/403), one that answers 4xx
with its own message, a timeout: each becomes one sentence on stderr and a non-zero exit;
the traceback is printed only with ``mesh --debug``. Errors are recognised through their
cause chain, because the a2a-sdk wraps httpx's errors in its own.

**The commands.** They talk to any A2A agent through the a2a-sdk client (``capacity`` is a
plain GET of the coordinator's ``/capacity``). Every command takes ``--token`` (default:
``$MESH_TOKEN``).

Exit status of ``send`` and ``result`` follows the task's state: 0 completed, 1 failed,
2 canceled or rejected, 3 stopped in another state (input or auth required; for
``result``, also not finished yet), 4 the request itself failed (unreachable, 401, 429,
bad request, an unknown task id). Ctrl-C during ``send`` leaves the task running on the
server and prints the commands that fetch its answer (``mesh result``) or cancel it; exit
130. ``cancel`` exits 0 when the task ends canceled, 1 when it cannot be canceled (unknown
or already finished).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from a2a.client import Client, ClientConfig, ClientFactory
from a2a.client.errors import A2AClientTimeoutError, AgentCardResolutionError
from a2a.types import a2a_pb2 as pb
from a2a.utils.constants import TransportProtocol
from a2a.utils.errors import A2AError, TaskNotFoundError

__all__ = ["describe", "exit_status", "register", "server_message", "status_line"]

T = TypeVar("T")


# -------------------- errors --------------------------------------------------

_DEBUG_HINT = "rerun with `mesh --debug ...` for the traceback"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        if isinstance(cur, BaseExceptionGroup) and cur.exceptions:
            cur = cur.exceptions[0]  # a task group's first failure is the one that matters
        else:
            cur = cur.__cause__ or cur.__context__


def server_message(response: httpx.Response) -> str:
    """The error text a server put in its body (A2A/JSON-RPC/REST/OpenAI shapes), else
    the first 200 characters of the body."""
    try:
        doc = response.json()
    except (ValueError, UnicodeDecodeError):
        return response.text.strip()[:200]
    for path in (("error", "message"), ("message",), ("detail",), ("error",)):
        cur: object = doc
        for key in path:
            cur = cur.get(key) if isinstance(cur, dict) else None
        if isinstance(cur, str) and cur:
            return cur
    return json.dumps(doc)[:200]


def status_line(code: int, where: str, text: str) -> str:
    """One line for an HTTP error status ``code`` from ``where`` whose body said ``text``."""
    said = f": {text}" if text else ""
    if code in (401, 403):
        return (f"{where} refused the request ({code}{said}); pass --token TOKEN or set "
                "MESH_TOKEN to a token the server accepts (its --auth-token)")
    if code == 404:
        return (f"{where} has no such route (404{said}); check the URL: it should be a "
                "mesh server's base URL, e.g. http://127.0.0.1:8700")
    if code == 429:
        return f"{where} is over capacity (429{said}); retry later"
    if code == 413:
        return f"{where} refused the request as too large (413{said})"
    if 400 <= code < 500:
        return f"{where} refused the request ({code}{said})"
    return f"{where} failed ({code}{said}); see the server's log"


def describe(exc: BaseException, url: str | None = None) -> str:
    """One line for ``exc`` naming the fix; ``url`` is the server the command talked to."""
    where = url.rstrip("/") if url else "the server"
    for e in _chain(exc):
        if isinstance(e, httpx.HTTPStatusError):
            return status_line(e.response.status_code, where, server_message(e.response))
        if isinstance(e, AgentCardResolutionError) and e.status_code is not None:
            return status_line(e.status_code, where, "")
        if isinstance(e, (httpx.ConnectError, ConnectionRefusedError)):
            return (f"cannot connect to {where}: nothing answers there; start it with "
                    "`mesh serve` or check the URL and port")
        if isinstance(e, (httpx.TimeoutException, A2AClientTimeoutError, TimeoutError)):
            return (f"{where} did not answer in time; raise --timeout, or check that it is "
                    "not overloaded (`mesh capacity URL`)")
        if isinstance(e, httpx.UnsupportedProtocol | httpx.InvalidURL):
            return f"{where} is not a valid URL ({e}); pass one like http://127.0.0.1:8700"
        if isinstance(e, httpx.RemoteProtocolError):
            return (f"{where} closed the connection mid-answer ({e}); is it an A2A server? "
                    "check the URL and the server's log")
    if isinstance(exc, A2AError | httpx.HTTPError):
        # An A2AError is the server's own JSON-RPC error message: it already names the fix.
        return f"{where}: {exc}"
    return f"{type(exc).__name__}: {exc}; {_DEBUG_HINT}"

# -------------------- the commands --------------------------------------------

EXIT_COMPLETED, EXIT_FAILED, EXIT_CANCELED, EXIT_OTHER, EXIT_ERROR = 0, 1, 2, 3, 4


_EXITS: dict[int, int] = {pb.TaskState.TASK_STATE_COMPLETED: EXIT_COMPLETED,
                          pb.TaskState.TASK_STATE_FAILED: EXIT_FAILED,
                          pb.TaskState.TASK_STATE_CANCELED: EXIT_CANCELED,
                          pb.TaskState.TASK_STATE_REJECTED: EXIT_CANCELED}


def exit_status(state: int) -> int:
    """The exit status for a task that ended in ``state``."""
    return _EXITS.get(state, EXIT_OTHER)


def _state_name(state: int) -> str:
    name: str = pb.TaskState.Name(state)
    return name.removeprefix("TASK_STATE_").lower()


def _text(parts: Any) -> str:
    return "".join(p.text for p in parts if p.HasField("text"))


def _http(args: argparse.Namespace) -> httpx.AsyncClient:
    token = args.token or os.environ.get("MESH_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(args.timeout, connect=10.0))


async def _client(http: httpx.AsyncClient, url: str, *, streaming: bool) -> Client:
    config = ClientConfig(httpx_client=http, streaming=streaming, supported_protocol_bindings=[
        TransportProtocol.JSONRPC.value, TransportProtocol.HTTP_JSON.value])
    return await ClientFactory(config).create_from_url(url.rstrip("/"))


async def _call(args: argparse.Namespace, request: Callable[[Client], Awaitable[T]]) -> T:
    """One non-streaming request to the agent at ``args.url``; its errors go up (to
    :func:`_runner`, which makes them one line)."""
    async with _http(args) as http:
        client = await _client(http, args.url, streaming=False)
        try:
            return await request(client)
        finally:
            await client.close()


def _say(args: argparse.Namespace, message: str) -> None:
    """One error line on stderr, in the one style: ``mesh COMMAND: message``."""
    print(f"mesh {args.client_command}: {message}", file=sys.stderr)


def _err(args: argparse.Namespace, message: str) -> int:
    _say(args, message)
    return EXIT_ERROR


def _failed(exc: BaseException, args: argparse.Namespace) -> int:
    """A request that failed: one line naming the fix (the traceback with --debug)."""
    if getattr(args, "debug", False):
        raise exc
    return _err(args, describe(exc, args.url))


def _again(args: argparse.Namespace, command: str, task_id: str) -> str:
    """The ``mesh`` command line that runs ``command`` on ``task_id`` at the same server
    (with ``--token TOKEN`` when this one was given a token by flag: it is not echoed)."""
    token = " --token TOKEN" if getattr(args, "token", None) else ""
    return f"mesh {command} {args.url} {task_id}{token}"


# --------------------------------------------------------------------------- send


@dataclass
class _Stream:
    """What ``send`` has learnt and shown so far: the task id (for a Ctrl-C that comes
    mid-stream) and its state, and where the output stands."""

    is_verbose: bool  # --stream
    task_id: str = ""
    state: int = pb.TaskState.TASK_STATE_UNSPECIFIED
    current: str = ""  # the stream whose chunks were written last
    has_streamed: bool = False
    is_noting: bool = False  # the last status line was generated text (no newline yet)

    def show(self, response: pb.StreamResponse) -> None:
        """Note a task or status update and print it; print a worker's streamed text."""
        if response.HasField("task"):
            self.task_id, self.state = response.task.id, response.task.status.state
            if self.is_verbose:
                print(f"[{_state_name(self.state)}] task {self.task_id}", file=sys.stderr)
        elif response.HasField("status_update"):
            update = response.status_update
            self.task_id, self.state = update.task_id, update.status.state
            note = _text(update.status.message.parts)
            if _is_text_note(update.status.message):  # the plan forming: a note
                sys.stderr.write(note)
                self.is_noting = True
                return
            if self.is_noting:
                sys.stderr.write("\n")
                self.is_noting = False
            print(f"[{_state_name(self.state)}] {note}".rstrip(), file=sys.stderr)
        elif response.HasField("artifact_update"):
            artifact = response.artifact_update.artifact
            if artifact.artifact_id.startswith("stream-"):
                # Workers stream at once: each switch of stream starts a new line under its
                # label, so interleaved chunks stay readable.
                if artifact.artifact_id != self.current:
                    label = artifact.artifact_id.removeprefix("stream-")
                    sys.stdout.write(("\n" if self.current else "") + f"[{label}] ")
                    self.current = artifact.artifact_id
                sys.stdout.write(_text(artifact.parts))
                sys.stdout.flush()
                self.has_streamed = True


async def _send(args: argparse.Namespace, seen: _Stream) -> int:
    async with _http(args) as http:
        client = await _client(http, args.url, streaming=args.stream)
        message = pb.Message(role=pb.Role.ROLE_USER, message_id=uuid.uuid4().hex,
                             parts=[pb.Part(text=args.text)], context_id=args.context or "",
                             task_id=args.task or "")
        try:
            async for response in client.send_message(pb.SendMessageRequest(message=message)):
                if response.HasField("message"):
                    print(_text(response.message.parts))
                    return EXIT_COMPLETED
                seen.show(response)
            if not seen.task_id:
                return _err(args, "the agent answered with neither a message nor a task")
            task = await client.get_task(pb.GetTaskRequest(id=seen.task_id))
        finally:
            await client.close()
    if seen.has_streamed:
        print()
    return _report(task, args)


def _report(task: pb.Task, args: argparse.Namespace) -> int:
    """Print a task that stopped: its answer on stdout, its state and what to do next on
    stderr; the exit status for its state."""
    answer = _answer(task)
    if answer:
        print(answer)
    reason = _text(task.status.message.parts)
    print(f"[{_state_name(task.status.state)}] task {task.id} (context {task.context_id}): "
          f"{reason}", file=sys.stderr)
    if task.status.state == pb.TaskState.TASK_STATE_INPUT_REQUIRED:
        print(f"reply with: mesh send {args.url} --task {task.id} \"ANSWER\"", file=sys.stderr)
    elif task.status.state == pb.TaskState.TASK_STATE_COMPLETED and task.context_id:
        print(f"follow up with: mesh send {args.url} --context {task.context_id} \"...\"",
              file=sys.stderr)
    return exit_status(task.status.state)


def _interrupted(args: argparse.Namespace, task_id: str) -> int:
    """Ctrl-C during ``send``: the task is the server's, and goes on there."""
    if not task_id:
        _say(args, "interrupted before the server named the task; if it made one, "
                   f"`mesh tasks {args.url}` lists it")
        return 130
    _say(args, f"interrupted; task {task_id} goes on on the server")
    print(f"  its answer, once it is done: {_again(args, 'result', task_id)}\n"
          f"  cancel it:                   {_again(args, 'cancel', task_id)}", file=sys.stderr)
    return 130


def _is_text_note(message: pb.Message) -> bool:
    """A status line that is generated text (the plan forming), not a step."""
    fields = message.metadata.fields
    return "event" in fields and fields["event"].string_value == "text"


def _answer(task: pb.Task) -> str:
    from mesh.agent.task import ANSWER_ARTIFACT

    for artifact in task.artifacts:
        if artifact.artifact_id == ANSWER_ARTIFACT:
            return _text(artifact.parts)
    finals = [a for a in task.artifacts if not a.artifact_id.startswith("stream-")]
    return "\n".join(_text(a.parts) for a in finals)


# --------------------------------------------------------------------------- result, tasks, cancel


_RUNNING = frozenset({pb.TaskState.TASK_STATE_SUBMITTED, pb.TaskState.TASK_STATE_WORKING})


async def _result(args: argparse.Namespace) -> int:
    try:
        task = await _call(args, lambda c: c.get_task(pb.GetTaskRequest(id=args.id)))
    except TaskNotFoundError:
        return _err(args, f"{args.url.rstrip('/')} has no task {args.id} (a mistyped id, "
                          "one another --token created, or one the server's --data-dir "
                          f"no longer holds); `mesh tasks {args.url}` lists yours")
    if task.status.state in _RUNNING:
        note = _text(task.status.message.parts).replace("\n", " ")
        print(f"[{_state_name(task.status.state)}] task {task.id} is not finished"
              + (f" ({note})" if note else "") + f"; ask again later: "
              f"{_again(args, 'result', task.id)}, or cancel it: "
              f"{_again(args, 'cancel', task.id)}", file=sys.stderr)
        return EXIT_OTHER
    return _report(task, args)


async def _tasks(args: argparse.Namespace) -> int:
    request = pb.ListTasksRequest(page_size=args.limit)
    if args.state:
        request.status = pb.TaskState.Value("TASK_STATE_" + args.state.upper())
    page = await _call(args, lambda c: c.list_tasks(request))
    if not page.tasks:
        print("no tasks")
        return 0
    print(f"{'ID':36}  {'STATE':10}  {'UPDATED':20}  STATUS")
    for task in page.tasks:
        when = task.status.timestamp.ToDatetime().strftime("%Y-%m-%d %H:%M:%S")
        note = _text(task.status.message.parts).replace("\n", " ")[:60]
        print(f"{task.id:36}  {_state_name(task.status.state):10}  {when:20}  {note}")
    if page.total_size > len(page.tasks):
        print(f"({len(page.tasks)} of {page.total_size}; --limit N for more)")
    return 0


async def _cancel(args: argparse.Namespace) -> int:
    async def cancel(client: Client) -> pb.Task | A2AError:
        try:
            return await client.cancel_task(pb.CancelTaskRequest(id=args.id))
        except A2AError as e:  # the task's refusal; an agent not reached goes up as usual
            return e

    task = await _call(args, cancel)
    if isinstance(task, A2AError):
        _say(args, f"cannot cancel {args.id}: {describe(task, args.url)}")
        return EXIT_FAILED
    print(f"[{_state_name(task.status.state)}] task {task.id}")
    return 0 if task.status.state == pb.TaskState.TASK_STATE_CANCELED else EXIT_FAILED


async def _capacity(args: argparse.Namespace) -> int:
    async with _http(args) as http:
        response = await http.get(args.url.rstrip("/") + "/capacity")
    if response.status_code != 200:
        return _err(args, status_line(response.status_code, args.url.rstrip("/"),
                                      server_message(response)))
    print(json.dumps(response.json(), indent=2, sort_keys=True))
    return 0


# --------------------------------------------------------------------------- wiring


Command = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


def _runner(coro_fn: Command) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(asyncio.run(coro_fn(args)))
        except (httpx.HTTPError, A2AError, OSError) as e:
            return _failed(e, args)

    return run


def _run_send(args: argparse.Namespace) -> int:
    """``send``, whose Ctrl-C names the task it leaves running and how to reach it."""
    seen = _Stream(is_verbose=args.stream)
    try:
        return _runner(functools.partial(_send, seen=seen))(args)
    except KeyboardInterrupt:
        return _interrupted(args, seen.task_id)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the agent's base URL, e.g. http://127.0.0.1:8700")
    parser.add_argument("--token", help="bearer token (default: $MESH_TOKEN)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for a reply (default 600)")


def register(subparsers: Any) -> None:
    """Add ``send``, ``result``, ``tasks``, ``cancel`` and ``capacity`` to the ``mesh``
    command."""
    send = subparsers.add_parser("send",
                                 help="send a message to an A2A agent and print the answer",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(send)
    send.add_argument("text", help="the message text")
    send.add_argument("--stream", action="store_true",
                      help="stream status and generated text as they arrive")
    send.add_argument("--context", default=None, metavar="ID",
                      help="continue this conversation (a contextId an earlier send printed)")
    send.add_argument("--task", default=None, metavar="ID",
                      help="answer this task's question (a task in input-required)")
    send.set_defaults(func=_run_send, client_command="send")

    result = subparsers.add_parser(
        "result", help="print a task's answer (or its state, while it runs)")
    _common(result)
    result.add_argument("id", help="the task id (`mesh send` prints it; `mesh tasks` lists them)")
    result.set_defaults(func=_runner(_result), client_command="result")

    tasks = subparsers.add_parser("tasks", help="list the tasks an agent holds for you")
    _common(tasks)
    tasks.add_argument("--limit", type=int, default=50, help="most tasks to list (1..100)")
    tasks.add_argument("--state", help="only tasks in this state", choices=[
        "submitted", "working", "completed", "failed", "canceled", "rejected"])
    tasks.set_defaults(func=_runner(_tasks), client_command="tasks")

    cancel = subparsers.add_parser("cancel", help="cancel a task")
    _common(cancel)
    cancel.add_argument("id", help="the task id")
    cancel.set_defaults(func=_runner(_cancel), client_command="cancel")

    capacity = subparsers.add_parser("capacity", help="show the coordinator's /capacity")
    _common(capacity)
    capacity.set_defaults(func=_runner(_capacity), client_command="capacity")
