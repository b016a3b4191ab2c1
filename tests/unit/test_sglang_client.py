"""The one HTTP client of an engine: every way a request can fail ends as an EngineError naming the
engine and endpoint, which the engine actor turns into EngineDied when the server has exited."""

import socket
import threading

import pytest

from rlsys.rollout.sglang.client import EngineError, SGLangClient
from rlsys.system.topology import EngineAddress


def _server_cut_off_mid_answer() -> tuple[int, threading.Thread]:
    """A server that promises 17048 bytes, sends 10 and closes: an engine killed while answering."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        connection, _ = listener.accept()
        request = b""
        while b"\r\n\r\n" not in request:  # the whole request is read: closing on unread bytes resets instead
            request += connection.recv(65536)
        head, _, body = request.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += connection.recv(65536)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 17048\r\n\r\n"
                           b'{"text": "')
        connection.shutdown(socket.SHUT_WR)  # an orderly end of the stream, 17038 bytes short
        connection.close()
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread


def test_an_answer_cut_off_mid_body_is_an_engine_error():
    port, thread = _server_cut_off_mid_answer()
    client = SGLangClient(EngineAddress("engine-0", f"http://127.0.0.1:{port}", "", 1), timeout_s=10)
    with pytest.raises(EngineError) as error:
        client.generate({"input_ids": [[1, 2]]})
    thread.join(5)
    assert error.value.endpoint == "/generate" and "its answer was cut off (IncompleteRead" in error.value.reason
