"""bench/validation.py: what it reads back from a run's MLflow store and how it sums the arms up; the
timing itself is the script's, not a test's."""
from __future__ import annotations

import sqlite3

from bench import validation


def _store(path, runtimes: list[float]) -> None:
    con = sqlite3.connect(path)
    con.executescript("CREATE TABLE runs (run_uuid TEXT, start_time INTEGER);"
                      "CREATE TABLE tags (run_uuid TEXT, key TEXT, value TEXT);"
                      "CREATE TABLE latest_metrics (run_uuid TEXT, key TEXT, value REAL);"
                      "CREATE TABLE metrics (run_uuid TEXT, key TEXT, value REAL, step INTEGER);")
    for run, start in (("old", 1), ("new", 2)):
        con.execute("INSERT INTO runs VALUES (?, ?)", (run, start))
        con.execute("INSERT INTO tags VALUES (?, 'stage', 'train')", (run,))
        con.execute("INSERT INTO latest_metrics VALUES (?, 'train_runtime', ?)", (run, 10.0 * start))
    for step, seconds in enumerate(runtimes, 1):
        con.execute("INSERT INTO metrics VALUES ('new', 'eval_runtime', ?, ?)", (seconds, step))
    con.commit()
    con.close()


def test_the_newest_training_runs_runtime_and_validation_points_are_read(tmp_path):
    _store(tmp_path / "mlflow.db", [0.5, 0.25, 0.25])
    assert validation.run_figures(tmp_path / "mlflow.db") == {"train_runtime_s": 20.0, "points": 3,
                                                              "eval_runtime_s": 1.0}


def test_the_summary_is_the_median_of_each_arm_and_the_ratio_of_their_walls():
    on, off = validation.ARMS["validation"], validation.ARMS["no validation"]
    results = [{"args": on, "wall_s": w, "train_runtime_s": 9.0, "points": 5, "eval_runtime_s": 1.0,
                "other_load_cores": 0.1} for w in (44.0, 42.0, 43.0)]
    results += [{"args": off, "wall_s": w, "train_runtime_s": 9.0, "points": 0, "eval_runtime_s": 0.0,
                 "other_load_cores": 0.0} for w in (40.0, 41.0, 39.0)]
    rows, ratio = validation.summary(results)
    assert rows[0] == ["validation", "3", "43.0", "9.0", "5", "1.00", "0.10"]
    assert rows[1][:3] == ["no validation", "3", "40.0"]
    assert ratio == 43.0 / 40.0
