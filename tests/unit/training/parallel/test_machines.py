"""Which machines of a launch share machine 0's checkpoint folder, and whether they resume the same checkpoint:
two "processes" as threads on one real TCPStore (the launch's rendezvous store), one folder or one each."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from onegpu.errors import AlreadySaid, ConfigError
from onegpu.training.lifecycle.resume import ResumePoint
from onegpu.training.parallel import machines

torch_dist = pytest.importorskip("torch.distributed")


def _views(folders: list, found: list) -> list[list[dict]]:
    """Each of 2 processes (ranks 0 and 1, machines 0 and 1) runs :func:`machines._exchange` at once with its own
    folder and the checkpoint it found; returns each one's list of every process's view."""
    from tests.unit.training.parallel.test_distributed import _free_port
    port = _free_port()
    server = torch_dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30),
                                 wait_for_workers=False)
    out, errors = [None, None], []

    def one(rank: int) -> None:
        try:
            store = torch_dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30),
                                        wait_for_workers=False)
            out[rank] = machines._exchange(store, rank, rank, 2, folders[rank], found[rank])
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    del server
    assert not errors, errors
    return out


def test_a_folder_both_machines_see_is_shared_and_rank_0_leaves_nothing_in_it(tmp_path):
    folder = tmp_path / "checkpoints" / "abc"
    views = _views([folder, folder], [None, None])
    assert views[0] == views[1] == [{"machine": 0, "shared": True, "step": None, "sharded": None},
                                    {"machine": 1, "shared": True, "step": None, "sharded": None}]
    assert not folder.exists()  # made for the marker, removed with it


def test_a_folder_of_its_own_is_not_shared_and_a_folder_with_checkpoints_is_kept(tmp_path):
    zero, one = tmp_path / "m0" / "abc", tmp_path / "m1" / "abc"
    (zero / "checkpoint-2").mkdir(parents=True)
    point = ResumePoint(str(zero / "checkpoint-2"), 2)
    views = _views([zero, one], [point, point])
    assert [v["shared"] for v in views[1]] == [True, False]  # rank 0 sees its own marker
    assert [v["step"] for v in views[0]] == [2, 2]
    assert sorted(p.name for p in zero.iterdir()) == ["checkpoint-2"]  # the marker gone, the folder kept
    machines.check_same_checkpoint(views[0], zero)  # the same step on both: no error


def test_machines_that_found_different_checkpoints_are_refused_in_one_line(tmp_path):
    seen = [{"machine": 0, "shared": True, "step": 4, "sharded": None},
            {"machine": 0, "shared": True, "step": 4, "sharded": None},
            {"machine": 1, "shared": False, "step": None, "sharded": None}]
    with pytest.raises(ConfigError) as e:
        machines.check_same_checkpoint(seen, tmp_path / "abc")
    message = str(e.value)
    assert "\n" not in message
    assert "machine 0 resumes after optimizer step 4, machine 1 finds none" in message
    assert "copy machine 0's folder to the others" in message
    seen[2]["step"] = 2
    with pytest.raises(ConfigError, match="machine 0 resumes after optimizer step 4, machine 1 resumes after "
                                          "optimizer step 2;"):
        machines.check_same_checkpoint(seen, tmp_path / "abc")


def test_sharding_over_machines_needs_the_one_folder(tmp_path):
    seen = [{"machine": 0, "shared": True, "step": None, "sharded": None},
            {"machine": 1, "shared": False, "step": None, "sharded": None}]
    with pytest.raises(ConfigError, match=r"train.fsdp.enabled: sharding over several machines needs one checkpoint "
                                          r"folder that every machine sees, and machine 1 does not see"):
        machines.check_one_folder(seen, tmp_path)
    seen[1]["shared"] = True
    machines.check_one_folder(seen, tmp_path)


def test_on_one_machine_agree_does_nothing_and_rank_0_alone_writes(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(machines, "_layout", {"own_folders": False, "writes": None})
    machines.agree(tmp_path / "abc", None, sharded=True)  # no store is asked: none exists here
    assert not machines.writes_checkpoint() and not machines.own_folders()
    assert not (tmp_path / "abc").exists()


def test_the_first_process_of_a_machine_with_its_own_folder_writes(monkeypatch, tmp_path):
    """Machine 1 of 2 (ranks 2 and 3 of 4) with a folder of its own: its local rank 0 writes, its local rank 1 not."""
    seen = [{"machine": m, "shared": m == 0, "step": None, "sharded": None} for m in (0, 0, 1, 1)]
    monkeypatch.setattr(machines.distributed, "_store", lambda timeout_s: None)
    monkeypatch.setattr(machines, "_exchange", lambda *a: seen)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for rank, writes in ((2, True), (3, False), (0, True), (1, False)):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
        monkeypatch.setattr(machines, "_layout", {"own_folders": False, "writes": None})
        machines.agree(tmp_path, None)
        assert (machines.writes_checkpoint(), machines.own_folders()) == (writes, True), rank
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError, match="machine 1 does not see"):  # machine 1's first process says it
        machines.agree(tmp_path, None, sharded=True)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(AlreadySaid, match="machine 1 does not see"):  # not its machine's first: exits 2 quietly
        machines.agree(tmp_path, None, sharded=True)
