"""tests/ports.py: the ports test processes take for their servers never meet."""

from __future__ import annotations

import socket

import pytest

from tests import ports


def slices(monkeypatch: pytest.MonkeyPatch, span: range) -> list[range]:
    """The slice of ``span`` that each of the three workers of one run (``make test``) takes."""
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "a-run")
    out = []
    for worker in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        cut = ports._Slice(span, 0)
        out.append(range(cut.start, cut.stop))
    return out


def test_the_workers_of_a_run_search_disjoint_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Modules searched ranges of their own, from starts that overlapped other modules' ranges:
    one worker's router took the port of a node another worker had stopped to start it again."""
    for span in (ports.NODES, ports.SERVERS):
        taken = slices(monkeypatch, span)
        assert all(cut.start >= span.start and cut.stop <= span.stop for cut in taken)
        assert len({p for cut in taken for p in cut}) == sum(len(cut) for cut in taken)


def test_no_server_port_is_a_node_port_or_a_bus_port_and_all_are_below_the_ephemeral_range() -> None:
    nodes = set(ports.NODES) | {p + 10000 for p in ports.NODES}
    assert not nodes & set(ports.SERVERS)
    assert max(nodes | set(ports.SERVERS)) < 32768 and 6379 not in nodes | set(ports.SERVERS)


def test_a_port_handed_out_is_not_handed_out_again_until_the_slice_wraps() -> None:
    """A node stopped and started again on its port: this process's own later servers do not take
    it meanwhile."""
    cut = ports._Slice(range(20000, 20000 + 40 * ports.SLOTS), 2)
    first = cut.take(3, lambda port: True)
    assert cut.take(3, lambda port: True) == first + 3 + 2  # the spare ports left for added nodes
    assert cut.take(1, lambda port: port % 2 == 1) % 2 == 1  # a port not free is skipped
    alone = ports._Slice(range(20000, 20000 + 40 * ports.SLOTS), 0)
    handed = [alone.take(1, lambda port: True) for _ in range(40)]
    assert len(set(handed)) == 40 and alone.take(1, lambda port: True) == handed[0]
    with pytest.raises(RuntimeError):
        alone.take(1, lambda port: False)


def test_a_server_socket_holds_its_port_from_its_pick() -> None:
    """A port checked free and bound later could be taken in between by a process of another
    session sharing this one's slice; the socket handed out is bound already, so no other bind
    takes its port, and the port is not handed out again."""
    held = ports.server_socket()
    try:
        port = held.getsockname()[1]
        assert port in ports.SERVERS
        other = socket.socket()
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        assert ports.server_port() != port
    finally:
        held.close()
