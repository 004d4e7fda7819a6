"""The `--ray` driver without a cluster: how it joins Ray (a Ray of its own on 127.0.0.1 in a
fresh directory with its own token; a loopback address kept on loopback; a remote one left as it
is), and how it hands out batches (lazily, a bounded number per actor, results in input order
whatever order the actors finish in)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from semif_serve.batch.ray_job import AHEAD, UNWRITTEN_PER_ACTOR, in_order, is_loopback, session_for


def test_without_an_address_the_job_starts_a_ray_of_its_own_on_loopback_in_a_fresh_directory():
    session = session_for(None, num_actors=2, temp_dir="/tmp/semif-ray-x")
    assert session.init["address"] == "local"  # never a cluster an earlier Ray left on the machine
    assert session.init["_node_ip_address"] == "127.0.0.1"
    assert session.init["_temp_dir"] == "/tmp/semif-ray-x"
    assert session.init["include_dashboard"] is False
    assert (
        session.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    )  # else Ray swaps 127.0.0.1 for the LAN address
    assert session.env["RAY_AUTH_MODE"] == "token" and len(session.env["RAY_AUTH_TOKEN"]) == 64
    assert session.env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] == "0"
    assert session_for(None, 2, "/t").env["RAY_AUTH_TOKEN"] != session.env["RAY_AUTH_TOKEN"]


def test_a_loopback_address_keeps_the_driver_on_loopback_and_a_remote_one_is_left_alone():
    local = session_for("127.0.0.1:6379", num_actors=1, temp_dir="/t")
    assert local.init == {"address": "127.0.0.1:6379", "_node_ip_address": "127.0.0.1"}
    assert local.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    remote = session_for("10.0.0.5:6379", num_actors=1, temp_dir="/t")
    assert remote.init == {"address": "10.0.0.5:6379"}
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in remote.env
    assert [is_loopback(a) for a in ("localhost:1", "127.0.0.2:1", "[::1]:1", "ray://10.1.1.1:10001")] == [
        True,
        True,
        True,
        False,
    ]


class Ref:
    """A batch handed to an actor (hashable by identity, as Ray's references are)."""

    def __init__(self, actor: int, batch: list) -> None:
        self.actor, self.batch, self.done = actor, batch, False


class FakeRay:
    """Actors that finish the newest running batch first (the worst order for writing in order),
    noting the most batches any actor had running."""

    def __init__(self, actors: int) -> None:
        self.running: list[Ref] = []
        self.most_on_one_actor = 0
        self.actors = [
            SimpleNamespace(score=SimpleNamespace(remote=self._submitter(i))) for i in range(actors)
        ]

    def _submitter(self, actor: int):
        def remote(batch):
            ref = Ref(actor, batch)
            self.running.append(ref)
            on_actor = sum(1 for r in self.running if r.actor == actor)
            self.most_on_one_actor = max(self.most_on_one_actor, on_actor)
            return ref

        return remote

    def wait(self, refs, num_returns=1):
        newest = self.running.pop()
        assert newest in refs
        newest.done = True
        return [newest], [r for r in refs if r is not newest]

    def get(self, ref):
        assert ref.done, "a result was fetched before its batch finished"
        return [f"result of line {number}" for number, _ in ref.batch]


@pytest.mark.parametrize("actors", [1, 3])
def test_batches_are_handed_out_lazily_a_few_per_actor_and_written_in_input_order(actors):
    ray = FakeRay(actors)
    handed = []

    def batches():
        for start in range(0, 200, 5):
            batch = [(number, b"{}") for number in range(start, start + 5)]
            handed.append(batch)
            yield batch

    written = []
    most_out = 0
    for results in in_order(ray, ray.actors, batches()):
        most_out = max(most_out, len(handed) - len(written))
        written.append(results)
    assert [r for results in written for r in results] == [f"result of line {n}" for n in range(200)]
    assert ray.most_on_one_actor <= AHEAD
    assert most_out <= UNWRITTEN_PER_ACTOR * actors  # the driver never holds every line
