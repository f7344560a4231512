"""slime's custom reward, ``--custom-rm-path module.function`` with slime's ``custom_rm(args, sample)``, on vime's
reward path (vime.slime_reward): scored by the reward actor, a plain function in a reward worker process and an
async one in the actor, each sample built from what the rollout sent; a bad path or signature refused naming the
flag and the fix."""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path

import pytest
import trio

from vime.config import RunConfig
from vime.messages.pipeline import GenerateGroup, RolloutGroup, Sample
from vime.reward_workers import RewardWorkers

SLIME_REWARDS = '''
    import json
    import os


    def _record(args, sample):
        """What the reward saw, written to the file the row's metadata names; 1.0 for a right answer."""
        seen = {"prompt": sample.prompt, "tokens": sample.tokens, "response": sample.response,
                "response_length": sample.response_length, "label": sample.label, "metadata": sample.metadata,
                "status": sample.status.name, "group_index": sample.group_index, "index": sample.index,
                "reward": sample.reward, "n_samples_per_prompt": args.n_samples_per_prompt,
                "group_size": args.group_size, "hf_checkpoint": args.hf_checkpoint, "pid": os.getpid()}
        with open(sample.metadata["record"], "a") as out:
            out.write(json.dumps(seen) + "\\n")
        return 1.0 if sample.response == sample.label else 0.0


    async def async_rm(args, sample):
        return _record(args, sample)


    def sync_rm(args, sample):
        return _record(args, sample)


    def vime_form(response, label, **metadata):
        return 1.0


    def one_argument(sample):
        return 1.0


    async def gives_a_dict(args, sample):
        return {"accuracy": 1.0}
'''


@pytest.fixture(scope="module")
def plugin_folder(tmp_path_factory) -> Path:
    """A folder holding ``slime_rms.py``, the rewards as a slime user writes them."""
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "slime_rms.py").write_text(textwrap.dedent(SLIME_REWARDS))
    return folder


@pytest.fixture(autouse=True)
def plugins_importable(plugin_folder, monkeypatch):
    """Importable here and, through PYTHONPATH (which the reward workers inherit), in every process."""
    monkeypatch.syspath_prepend(str(plugin_folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(plugin_folder), os.environ.get("PYTHONPATH")])))


def _sample(index: int, response: str, finish_reason: str, record: Path) -> Sample:
    return Sample(group_id=7, index=index, prompt_ids=[11, 12, 13], response_ids=[21], logprobs=[0.0], versions=[0],
                  finish_reason=finish_reason,
                  label="4", metadata={"metadata": {"record": str(record)}, "data_source": "arithmetic"},
                  response_text=response, prompt_text="<|im_start|>user\n2+2?")


async def _scored_by_the_reward_actor(config: RunConfig, group: RolloutGroup) -> RolloutGroup:
    """``group`` through the reward actor as the rollout sends it; the group it sends on to the buffer."""
    from vime.actors.reward import Reward
    from vime.runtime import ActorSettings
    from vime.transports.codec import Envelope

    actor = Reward(ActorSettings(name="reward", listen="ipc:///nonexistent"), config.to_dict())
    sent = []
    actor._send_hook = lambda envelope: sent.append(envelope.payload)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            actor._nursery = nursery
            await actor.on_start()
            envelope = Envelope("RolloutGroup", "rollout-0", "reward", 1, None, 0.0, None, False, group)
            await actor._on_group(group, envelope)
            while not sent:
                await trio.sleep(0.05)
            await actor.on_stop()
            nursery.cancel_scope.cancel()
    return sent[0]


@pytest.mark.parametrize("function", ["async_rm", "sync_rm"])
async def test_a_slime_reward_scores_the_rollouts_samples_in_the_reward_actor(function, tmp_path):
    """async_rm runs in the actor, sync_rm in a reward worker process; each gets slime's sample of what the rollout
    sent and the run's settings as args, by slime's names and vime's. Before --custom-rm-path: no such setting."""
    record = tmp_path / "seen.jsonl"
    config = RunConfig().replace(custom_rm_path=f"slime_rms.{function}", group_size=2, model_path="/models/Qwen3")
    group = RolloutGroup(group_id=7, worker="rollout-0", generate_s=0.0, finished_at=0.0,
                         samples=[_sample(0, "4", "stop", record), _sample(1, "5", "length", record)])
    scored = await _scored_by_the_reward_actor(config, group)
    assert [sample.reward for sample in scored.samples] == [1.0, 0.0]
    seen = sorted(map(json.loads, record.read_text().splitlines()), key=lambda row: row["response"])
    in_the_actor = [row.pop("pid") == os.getpid() for row in seen]
    assert in_the_actor == [function == "async_rm"] * 2, "a plain function runs in a worker, an async one here"
    common = {"prompt": "<|im_start|>user\n2+2?", "label": "4", "metadata": {"record": str(record)},
              "group_index": 7, "index": None, "reward": None, "n_samples_per_prompt": 2, "group_size": 2,
              "hf_checkpoint": "/models/Qwen3"}
    assert seen == [{**common, "tokens": [11, 12, 13, 21], "response": "4", "response_length": 1,
                     "status": "COMPLETED"},
                    {**common, "tokens": [11, 12, 13, 21], "response": "5", "response_length": 1,
                     "status": "TRUNCATED"}]


def test_the_rollout_sends_the_prompt_as_the_engine_saw_it():
    """sample.prompt is the prompt's tokens decoded, special tokens kept (slime's prompt after its chat template)."""
    from vime.backends.base import SamplingParams, Sequence
    from vime.groups import Group

    class Tokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return " ".join(f"t{i}" for i in ids if not (skip_special_tokens and i == 0))

    request = GenerateGroup(group_id=3, prompt_ids=[0, 5, 6], messages=[], label="x", metadata={}, group_size=1,
                            min_weight_version=0, sampling={})
    group = Group(request, [Sequence(0, [0, 5, 6], SamplingParams(), finish_reason="stop")], time.monotonic())
    group.episodes[0].add_generated([0, 8], [0.0, 0.0], [0, 0])
    assert group.samples(Tokenizer())[0].prompt_text == ""  # not sent unless a slime reward reads it
    [sample] = group.samples(Tokenizer(), prompt_text=True)
    assert (sample.prompt_text, sample.response_text) == ("t0 t5 t6", "t8")


@pytest.mark.parametrize("spec, said", [
    ("slime_rms", "--custom-rm-path 'slime_rms': expected package.module.function (or package.module:function)"),
    ("no_such_module.custom_rm", "--custom-rm-path 'no_such_module.custom_rm': cannot import no_such_module"),
    ("slime_rms.missing", "--custom-rm-path 'slime_rms.missing': slime_rms has no function 'missing'"),
    ("slime_rms.vime_form", "--custom-rm-path slime_rms.vime_form: vime_form takes (response, label, ...), vime's "
                            "signature: pass it as --custom-reward"),
    ("slime_rms:one_argument", "--custom-rm-path slime_rms:one_argument: one_argument does not take slime's "
                               "(args, sample)"),
])
def test_a_bad_path_or_signature_is_refused_naming_the_flag_and_the_fix(spec, said):
    with pytest.raises(ValueError) as refused:
        RewardWorkers.for_run(RunConfig().replace(custom_rm_path=spec))
    assert said in str(refused.value)


def test_a_slime_function_given_as_custom_reward_is_pointed_to_custom_rm_path():
    with pytest.raises(ValueError, match=r"--custom-reward slime_rms:sync_rm: sync_rm takes \(args, sample\), slime's "
                                         r"signature: pass it as --custom-rm-path slime_rms:sync_rm"):
        RewardWorkers.for_run(RunConfig().replace(custom_reward="slime_rms:sync_rm"))


def test_custom_rm_path_is_a_flag_and_not_beside_custom_reward():
    from test_slime_flags import parse

    assert parse("--custom-rm-path", "slime_rms.async_rm").reward.custom_rm_path == "slime_rms.async_rm"
    with pytest.raises(ValueError, match="both name the reward: pass one of them"):
        parse("--custom-rm-path", "slime_rms.async_rm", "--custom-reward", "slime_rms:vime_form")


def test_the_contract_check_takes_a_slime_function_as_loaded():
    from vime.rewards import check_contract
    from vime.slime_reward import load

    with pytest.raises(TypeError, match="returned {'accuracy': 1.0}; .*not a dict of rewards"):
        check_contract(load("slime_rms.gives_a_dict"))


async def test_a_dict_reward_is_refused_before_the_run_saying_to_return_the_number():
    """slime takes a dict and picks with --reward-key, which vime has not: the preflight's call refuses it."""
    from vime.pipeline import check_reward

    config = RunConfig().replace(custom_rm_path="slime_rms.gives_a_dict")
    with pytest.raises(ValueError, match=r"--custom-rm-path slime_rms.gives_a_dict, called on a prompt's label as the "
                                         r"answer: .*returned \{'accuracy': 1.0\}; it must return a finite float: "
                                         r"return the reward itself, not a dict of rewards"):
        await check_reward(config, {"prompt": "2+2?", "label": "4"})
