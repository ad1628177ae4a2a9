"""bench/record_best.py: the decoding is chosen on validation alone, test
is only read, and the goal is the issue's."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "record_best", ROOT / "bench" / "record_best.py"
)
record_best = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record_best)

SETUPS = ["word, greedy", "word, beam 4", "word, beam 4 + average of last 5"]
FOLDER = "runs/recipe_sweep/best-x"


def bleu_table(path, split, scores, folder=FOLDER, other=(), setups=SETUPS):
    """A bleu_table.py JSON with one row per setup for `folder`, then
    rows of another folder with the scores in `other`."""
    rows = [
        {"setup": s, "bleu": b, "folder": f, "beam": 4, "average": 0}
        for f, bleus in ((folder, scores), ("checkpoints/cpu-bpe", other))
        for s, b in zip(setups, bleus)
    ]
    summary = {"command": f"python bench/bleu_table.py --split {split}"}
    summary |= {"split": split, "rows": rows}
    path.write_text(json.dumps(summary))
    return path


def a_trial():
    """What time_to_bleu.py writes, reduced to what record_best reads."""
    points = [
        {
            "epoch": e,
            "minutes": 5.0 * e,
            "val_loss": 2 - e / 10,
            "val_bleu": 30 + e,
            "steps": 153 * (e + 1),
        }
        for e in range(3)
    ]
    return {
        "command": "python bench/time_to_bleu.py --preset cpu",
        "checkpoint": f"{FOLDER}/final.pt",
        "threads": 1,
        "hardware": {"cpu": "AMD EPYC"},
        "precision": "float32",
        "config": {"dropout": 0.3},
        "points": points,
        "wall_seconds": 600.0,
        "train_seconds": 550.0,
        "load_average_end": [2.0, 2.0, 2.0],
    }


def test_choice_is_made_on_validation_not_test(tmp_path):
    # Another folder's rows score higher, and are not the trial's.
    val = bleu_table(
        tmp_path / "val.json", "validation", [38, 40.5, 40.0], other=[45] * 3
    )
    # On test the averaged model would win; the record must not pick it.
    test = bleu_table(
        tmp_path / "test.json", "test2016", [39.1, 41.0, 42.5], other=[1] * 3
    )
    result = record_best.record(a_trial(), val, test)
    assert result["best_decoding"].startswith("word, beam 4;")
    assert result["test2016_bleu_best"] == 41.0
    assert result["test2016_bleu_greedy"] == 39.1
    assert result["goal_met"] is False
    assert result["recipe"] == "best-x" and result["steps"] == 459
    assert result["epochs"] == 3 and result["train_seconds"] == 600.0


def test_greedy_on_an_averaged_model_is_chosen_on_validation(tmp_path):
    """bleu_table --greedy-average adds greedy rows on averaged models;
    the record's greedy score is the one validation prefers."""
    setups = [*SETUPS, "word, greedy + average of last 5"]
    val = tmp_path / "val.json"
    bleu_table(val, "validation", [38, 40, 41, 39], setups=setups)
    test = tmp_path / "test.json"
    bleu_table(test, "test2016", [39.5, 40, 41, 39], setups=setups)
    result = record_best.record(a_trial(), val, test)
    assert result["greedy_decoding"].startswith(
        "word, greedy + average of last 5;"
    )
    assert result["test2016_bleu_greedy"] == 39  # not test's better 39.5
    assert result["best_decoding"].startswith(
        "word, beam 4 + average of last 5;"
    )


@pytest.mark.parametrize(
    "greedy, best, met",
    [(39.0, 42.0, True), (38.99, 43, False), (40, 41.99, False)],
)
def test_goal(greedy, best, met):
    assert record_best.goal_met(greedy, best) is met


def test_tables_of_the_wrong_split_are_refused(tmp_path, capsys):
    val = bleu_table(tmp_path / "val.json", "test2016", [1, 2, 3])
    test = bleu_table(tmp_path / "test.json", "test2016", [1, 2, 3])
    trial = tmp_path / "trial.json"
    trial.write_text(json.dumps(a_trial()))
    argv = [str(trial), "--val", str(val), "--test", str(test)]
    with pytest.raises(SystemExit):
        record_best.main([*argv, "--out", str(tmp_path / "out.json")])
    err = capsys.readouterr().err.strip()
    assert err.startswith("record_best: error:") and "\n" not in err
    assert not (tmp_path / "out.json").exists()


def test_tables_of_different_setups_are_refused(tmp_path):
    val = bleu_table(tmp_path / "val.json", "validation", [38, 40.5])
    test = bleu_table(tmp_path / "test.json", "test2016", [39, 41, 42])
    with pytest.raises(ValueError, match="different setups"):
        record_best.record(a_trial(), val, test)
    summary = json.loads(val.read_text())
    summary["command"] += " --n 100"
    summary["rows"].append({**summary["rows"][0], "setup": SETUPS[2]})
    val.write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="subset"):
        record_best.record(a_trial(), val, test)


def test_a_table_without_the_trial_folder_is_refused(tmp_path):
    val = bleu_table(
        tmp_path / "val.json", "validation", [1, 2, 3], "elsewhere"
    )
    test = bleu_table(tmp_path / "test.json", "test2016", [1, 2, 3])
    with pytest.raises(ValueError, match="no row for"):
        record_best.record(a_trial(), val, test)


def test_a_resumed_trial_keeps_its_resume_and_how_time_was_counted(
    tmp_path,
):
    val = bleu_table(tmp_path / "val.json", "validation", [38, 40, 41])
    test = bleu_table(tmp_path / "test.json", "test2016", [39, 40, 41])
    plain = record_best.record(a_trial(), val, test)
    assert "resume_command" not in plain
    assert plain["training_loop_seconds"] == 550.0
    resumed = a_trial() | {
        "seconds_mean": "from --started to the newest epoch file's time,"
        " less the pause before --resumed",
        "resume_command": "python -m annotated_transformer_tools train"
        " --resume",
        "paused_seconds": 1109.5,
        "train_seconds": 600.0,
    }
    result = record_best.record(resumed, val, test)
    assert result["resume_command"] == resumed["resume_command"]
    assert result["paused_seconds"] == 1109.5
    assert result["train_seconds_means"] == resumed["seconds_mean"]
    assert result["training_loop_seconds"] is None
    assert result["train_seconds"] == 600.0


def test_a_student_records_its_teachers_and_the_whole_cost(tmp_path, capsys):
    val = bleu_table(tmp_path / "val.json", "validation", [38, 40.5, 40.0])
    test = bleu_table(tmp_path / "test.json", "test2016", [39.1, 41.0, 42.5])
    sweep = tmp_path / "recipe_sweep"
    sweep.mkdir()
    for name, seconds in (("t0", 3000.0), ("t1", 3100.0)):
        (sweep / f"{name}.json").write_text(
            json.dumps({"wall_seconds": seconds})
        )
    trial = sweep / "best-x.json"
    trial.write_text(json.dumps(a_trial() | {"data": "data/kd"}))
    distill = tmp_path / "distill.json"
    runs = ["runs/recipe_sweep/t0:5", "runs/recipe_sweep/t1:0"]
    record = {"runs": runs, "seconds": 900.0, "folder": "data/kd"}
    distill.write_text(json.dumps(record))
    out = tmp_path / "out.json"
    argv = [str(trial), "--val", str(val), "--test", str(test)]
    with pytest.raises(SystemExit):  # a student needs --distill
        record_best.main([*argv, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert "give --distill" in err and "\n" not in err and not out.exists()

    result = record_best.main(
        [*argv, "--distill", str(distill), "--out", str(out)]
    )
    assert result["teachers_train_seconds"] == [3000.0, 3100.0]
    assert result["recipe_seconds"] == 3000 + 3100 + 900 + 600
    assert result["distillation"]["runs"] == runs
    assert result["training_data"].startswith("data/kd:")
    assert result["test2016_bleu_best"] == 41.0  # still chosen on val
    assert json.loads(out.read_text()) == result


def test_a_distillation_of_another_folder_is_refused(tmp_path):
    trial = a_trial() | {"data": "data/kd"}
    record = {"runs": [], "seconds": 1.0, "folder": "data/other"}
    with pytest.raises(ValueError, match="trained on data/kd"):
        record_best.distillation(trial, record, tmp_path)
    with pytest.raises(ValueError, match="trained on --data"):
        record_best.distillation(a_trial(), record, tmp_path)
