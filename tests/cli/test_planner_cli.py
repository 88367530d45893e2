"""``mesh send --task`` answers a question, ``--context`` continues a conversation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.cli.test_coordinator_cli import run
from tests.support.agent_helpers import Scripted, ScriptedEngine, plan_json, serve_agent


def test_send_answers_a_question_with_task_and_follows_up_with_context(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ask = json.dumps({"action": "ask", "question": "Which parcel service?"})
    # two subtasks a plan: one would be answered by its worker, without a synthesis turn
    engine = ScriptedEngine(Scripted([ask, plan_json("check express", "check the limit"),
                                      plan_json("check 25", "check the limit")],
                                     synthesis="Express takes 30 kg."))
    with serve_agent(tmp_path, engine) as served:
        assert run("send", served.url, "How heavy may a parcel be?") == 3  # input required
        err = capsys.readouterr().err
        assert "Which parcel service?" in err
        found = re.search(r"--task (\S+)", err)
        assert found, err
        assert run("send", served.url, "--task", found.group(1), "express") == 0
        out, err = capsys.readouterr()
        assert out.strip() == "Express takes 30 kg."
        context = re.search(r"--context (\S+)", err)
        assert context, err
        assert run("send", served.url, "--context", context.group(1), "And 25 kg?",
                   "--stream") == 0
        out, err = capsys.readouterr()
        assert '"action": "delegate"' in err  # the plan forming goes to stderr
        assert out.strip().endswith("Express takes 30 kg.")
        # each stream's text under its own label, one line per switch of stream
        streams = [line.split("] ", 1)[0] + "]" for line in out.splitlines()
                   if line.startswith("[")]
        assert streams[0] == "[p1]" and "[synthesis]" in streams, out
    last_plan = [p for p, params in engine.turns if params.grammar][-1]
    assert "Coordinator answered: Express takes 30 kg." in last_plan
    assert "User: express" in last_plan


def test_serve_plan_actions_flag() -> None:
    import argparse

    from mesh.agent.plans import plan_schema, schema_to_gbnf
    from mesh.agent.task import AgentConfig
    from mesh.cli import serve as serve_cli
    from mesh.cli.compose import default_plan_actions, plan_style

    parser = argparse.ArgumentParser(prog="mesh")
    serve_cli.register(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve"]).plan_actions is None  # chosen by the plan style
    assert parser.parse_args(["serve"]).plan_style == "auto"
    assert default_plan_actions("free") == ("delegate", "answer", "ask")
    assert default_plan_actions("guided") == ("delegate",)
    # auto: guided for a model known to be under 1B parameters (the embedded ones)
    assert plan_style("auto", 134_515_008) == "guided"
    assert plan_style("auto", 7_000_000_000) == "free"
    assert plan_style("auto", 0) == "free"  # unknown (a remote engine)
    assert plan_style("free", 1000) == "free"
    # --first-turn: any by default (forcing a call did not help SmolLM2), call on request
    assert parser.parse_args(["serve"]).first_turn == "any"
    assert parser.parse_args(["serve", "--first-turn", "call"]).first_turn == "call"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--first-turn", "auto"])
    args = parser.parse_args(["serve", "--plan-actions", "ask, delegate"])
    assert args.plan_actions == ("delegate", "ask")  # the planner's order
    for bad in ("delegate,shout", ""):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--plan-actions", bad])
    # delegate alone: the plan grammar admits no other action.
    only = AgentConfig(actions=("delegate",))
    grammar = schema_to_gbnf(plan_schema(only.max_subtasks, (), only.actions, only.text_max))
    for action in ("delegate", "answer", "ask"):
        assert (f'\\"{action}\\"' in grammar) == (action == "delegate"), action
