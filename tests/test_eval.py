"""`fcsd eval`: lm-eval on a tiny exported FarSkip model with the offline demo task; the JSON / table / plot report,
comparison mode, FarSkip connectivity inside lm-eval, run folders and the model card, and input errors."""

import json
from pathlib import Path

import pytest
import torch
from test_trainer import assets, config_for  # noqa: F401  (the module fixture is shared)

import fcsd
from fcsd.cli import main
from fcsd.distill.convert import convert
from fcsd.evaluate.harness import load_for_eval, run_suite
from fcsd.evaluate.suites import load_suite


@pytest.fixture(scope="module")
def exported(assets, tmp_path_factory):  # noqa: F811
    from transformers import AutoTokenizer

    from fcsd.export.save import export

    out = tmp_path_factory.mktemp("export") / "converted"
    model = fcsd.from_pretrained(str(assets / "model"), layers="all")
    return export(model, AutoTokenizer.from_pretrained(assets / "model"), out)


def test_eval_compares_original_and_converted(assets, exported, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "report"
    argv = ["eval", str(exported), "--suite", "demo", "--compare", str(assets / "model"), "--limit", "8"]
    assert main([*argv, "--output", str(out)]) == 0
    assert "| delta |" in capsys.readouterr().out
    results = {label: json.loads((out / f"results_{label}.json").read_text()) for label in ("original", "converted")}
    for result in results.values():  # lm-eval's own layout
        assert {"results", "configs", "versions", "n-shot", "higher_is_better", "n-samples"} <= set(result)
        assert set(result["results"]) == {"fcsd_demo_gen", "fcsd_demo_choice"}
        assert result["n-samples"]["fcsd_demo_choice"]["effective"] == 8
    scores = json.loads((out / "eval_summary.json").read_text())["scores"]
    for label in ("original", "converted"):
        choice = 100 * results[label]["results"]["fcsd_demo_choice"]["acc,none"]
        generation = 100 * results[label]["results"]["fcsd_demo_gen"]["exact_match,none"]
        assert scores[label] == pytest.approx({"demo-gen": generation, "demo-choice": choice,
                                               "Avg": (generation + choice) / 2})  # fmt: skip
    assert scores["delta"]["demo-choice"] == pytest.approx(
        scores["converted"]["demo-choice"] - scores["original"]["demo-choice"]
    )
    table = (out / "eval_table.md").read_text().splitlines()
    assert table[2] == "| Model | demo-gen | demo-choice | Avg |"
    assert [line.split(" |")[0] for line in table[4:]] == [
        "| original (model)",  # the base's hub id or folder name, never an absolute path
        f"| converted ({exported.name})",
        "| delta",
    ]
    assert (out / "eval_table.png").read_bytes()[:4] == b"\x89PNG"
    # the same report folder again without --compare: the earlier report's original results go with it (they stayed
    # beside the new table, which had no row for them)
    assert main([*argv[:-4], "--limit", "8", "--output", str(out)]) == 0
    assert not (out / "results_original.json").exists() and (out / "results_converted.json").exists()
    assert set(json.loads((out / "eval_summary.json").read_text())["scores"]) == {"converted"}


def hand_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context), written independently of lm-eval (same whole-string tokenization rule)."""
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = model(torch.tensor([whole])).logits.float().log_softmax(-1)[0]
    return float(sum(logp[i - 1, whole[i]] for i in range(len(context_ids), len(whole))))


def test_lm_eval_scores_the_farskip_connectivity(assets, exported, capfd):  # noqa: F811
    suite = load_suite("demo")
    suite.tasks = [spec for spec in suite.tasks if spec.task == "fcsd_demo_choice"]
    model, tokenizer = load_for_eval(str(exported), device="cpu")
    loading = capfd.readouterr()
    assert "custom code" not in loading.out + loading.err  # an export loads without a remote-code prompt
    assert fcsd.farskip_layers(model) == [0, 1, 2, 3]
    samples = run_suite(model, tokenizer, suite, limit=3, log_samples=True)["samples"]["fcsd_demo_choice"]
    stock = fcsd.from_pretrained(str(assets / "model")).eval()
    assert fcsd.farskip_layers(stock) == []
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["filtered_resps"], strict=True):
            ours = hand_loglikelihood(model, tokenizer, context, continuation)
            assert response[0] == pytest.approx(ours, abs=1e-4)
            assert abs(hand_loglikelihood(stock, tokenizer, context, continuation) - ours) > 1e-3


def test_eval_of_a_run_folder_updates_its_model_card(assets, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    convert(config_for(assets, run, "train.max_steps=2"))
    assert "## Evaluation" not in (run / "export" / "README.md").read_text()
    assert main(["eval", str(run), "--suite", "demo", "--limit", "4"]) == 0
    assert (run / "eval" / "results_converted.json").exists()
    card = (run / "export" / "README.md").read_text()
    assert "## Evaluation" in card and "| converted (" in card
    assert (run / "eval_table.md").read_text() == (run / "eval" / "eval_table.md").read_text()


def test_eval_input_errors(exported, tmp_path, capsys):
    bad_suite = tmp_path / "bad.yaml"
    bad_suite.write_text("name: bad\ntasks:\n  - {task: piqa, shots: 5}\n")
    cases = [
        (["--suite", "nope"], "unknown suite 'nope'"),
        (["--suite", str(bad_suite)], "shots"),
        (["--tasks", "no_such_task_xyz"], "unknown lm-eval task(s) ['no_such_task_xyz']"),
        (["--suite", "paper"], "add --allow-code-execution"),
        (["--tasks", " , "], "--tasks: give lm-eval task names"),
    ]
    for extra, message in cases:
        assert main(["eval", str(exported), *extra, "--output", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert message in err and "Loading weights" not in err  # refused before any model is loaded
    assert main(["eval", str(tmp_path / "missing"), "--suite", "demo"]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_users_own_task_loads_through_the_include_path(exported, tmp_path):
    import shutil

    folder = tmp_path / "my_tasks"
    shutil.copytree(Path(__file__).resolve().parents[1] / "eval" / "tasks" / "fcsd_demo", folder)
    for path in folder.glob("*.yaml"):
        path.unlink()
    task = (Path(__file__).resolve().parents[1] / "eval" / "tasks" / "fcsd_demo" / "fcsd_demo_choice.yaml").read_text()
    (folder / "my_choice.yaml").write_text(task.replace("task: fcsd_demo_choice", "task: my_choice"))
    out = tmp_path / "report"
    argv = ["eval", str(exported), "--tasks", "my_choice", "--include-path", str(folder), "--limit", "4"]
    assert main([*argv, "--output", str(out)]) == 0
    result = json.loads((out / "results_converted.json").read_text())
    assert list(result["results"]) == ["my_choice"] and result["n-samples"]["my_choice"]["effective"] == 4
    scores = json.loads((out / "eval_summary.json").read_text())["scores"]["converted"]
    assert scores["my_choice"] == pytest.approx(100 * result["results"]["my_choice"]["acc,none"])
