"""headloss.integrations.trl against TRL's own DPO, KTO, CPO and ORPO losses (trl from PyPI; skipped
without it), with a tiny randomly initialised Llama and a word-level tokenizer built here (nothing
downloaded), on the CPU backend:
- one batch, each loss type: the loss, every parameter's gradient and the logged metrics with the
  switch on equal TRL's (switch off) within fp32 tolerance;
- three training steps and an evaluation: the same loss curve and logs; under TRL's default bf16
  autocast, the head runs in bf16 (as TRL's) and the curve agrees to bf16's precision;
- options without a headloss equivalent are refused with a message naming them."""
import random
import warnings

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
pytest.importorskip("trl", reason="TRL is not installed (pip install trl)")

import headloss  # noqa: E402
from headloss.integrations.trl import apply_headloss, remove_headloss  # noqa: E402

WORDS = [f"w{i}" for i in range(93)]
# What TRL logs beside the loss's metrics, which headloss does not compute.
NOT_LOGGED = ("entropy", "mean_token_accuracy", "num_tokens")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def _model(seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(WORDS) + 4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.2, pad_token_id=0, bos_token_id=2, eos_token_id=1)
    return LlamaForCausalLM(cfg)


def _dataset(kind, n=12):
    from datasets import Dataset
    r = random.Random(7)
    text = lambda lo, hi: " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))  # noqa: E731
    # completions start with a space: the prompt's tokens stay a prefix of prompt + completion
    if kind == "kto":
        return Dataset.from_dict({"prompt": [text(2, 5) for _ in range(n)],
                                  "completion": [" " + text(1, 6) for _ in range(n)],
                                  "label": [i % 3 != 0 for i in range(n)]})
    return Dataset.from_dict({"prompt": [text(2, 5) for _ in range(n)], "chosen": [" " + text(1, 6) for _ in range(n)],
                              "rejected": [" " + text(1, 6) for _ in range(n)]})


def _trainer(kind, tmp_path, **config):
    """A TRL trainer of `kind` on the tiny model, fp32 unless `config` says otherwise (TRL's configs
    default to bf16 autocast); DPO and KTO with a reference of another seed (log-ratios not 0)."""
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    trainer, cfg = {"dpo": (DPOTrainer, DPOConfig), "kto": (KTOTrainer, KTOConfig), "cpo": (CPOTrainer, CPOConfig),
                    "orpo": (ORPOTrainer, ORPOConfig)}[kind]
    args = cfg(output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=3,
               learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
               **{"bf16": False, **config})
    ref = dict(ref_model=_model(1)) if kind in ("dpo", "kto") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer(_model(0), args=args, train_dataset=_dataset(kind), eval_dataset=_dataset(kind, 8),
                       processing_class=_tokenizer(), **ref)


def _store(trainer):
    return trainer._metrics if hasattr(trainer, "_metrics") else trainer._stored_metrics


def _step(trainer):
    """The loss, the parameters' gradients and the logged metrics of the first batch."""
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.model.zero_grad()
    _store(trainer)["train"].clear()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters()}
    return loss.item(), grads, {k: v[-1] for k, v in _store(trainer)["train"].items()}


DPO_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
             "apo_down", "discopop", "sigmoid_norm"]
CASES = ([("dpo", dict(loss_type=[t], label_smoothing=0.1 if t in ("robust", "exo_pair") else 0.0))
          for t in DPO_TYPES]
         + [("dpo", dict(loss_type=["sigmoid", "sft"], loss_weights=[0.8, 0.3])),
            ("dpo", dict(loss_type=["discopop"], discopop_tau=0.2, beta=0.3)),
            ("dpo", dict(precompute_ref_log_probs=True)),
            ("kto", {}), ("kto", dict(beta=0.3, desirable_weight=1.5, undesirable_weight=0.7)),
            ("cpo", dict(loss_type="sigmoid", cpo_alpha=0.5, label_smoothing=0.1)),
            ("cpo", dict(loss_type="hinge", cpo_alpha=0.0)), ("cpo", dict(loss_type="ipo", beta=0.5)),
            ("cpo", dict(loss_type="simpo", simpo_gamma=0.7, cpo_alpha=0.3, beta=2.0)),
            ("orpo", {}), ("orpo", dict(beta=0.5))])


@pytest.mark.parametrize("kind,config", CASES, ids=lambda c: c if isinstance(c, str) else
                         "-".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_one_step_matches_trl(kind, config, tmp_path):
    trainer = _trainer(kind, tmp_path, **config)
    theirs = _step(trainer)
    ours = _step(apply_headloss(trainer))
    remove_headloss(trainer)
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5)
    for name, g in theirs[1].items():  # each parameter's, relative to its largest element
        assert (ours[1][name] - g).abs().max() <= 2e-5 * g.abs().max(), name
    assert set(ours[2]) == set(theirs[2]) - set(NOT_LOGGED)
    units = kind == "dpo" and config.get("loss_type", [""])[0] in ("ipo", "sigmoid_norm")
    for name, value in ours[2].items():
        if units and name.startswith(("rewards", "logps")):
            continue  # mean log-probs there (TRL logs sums)
        assert value == pytest.approx(theirs[2][name], rel=1e-5, abs=1e-5), name
    assert _step(trainer)[0] == theirs[0]  # TRL's own loss again


def _logs(trainer):
    """The training logs of three steps, then an evaluation's, without the timings."""
    trainer.train()
    trainer.evaluate()
    return [{k: v for k, v in entry.items() if "runtime" not in k and "per_second" not in k}
            for entry in trainer.state.log_history]


@pytest.mark.parametrize("kind", ["dpo", "kto", "cpo", "orpo"])
def test_training_matches_trl(kind, tmp_path):
    config = dict(cpo=dict(cpo_alpha=0.5)).get(kind, {})
    theirs = _logs(_trainer(kind, tmp_path, **config))
    ours = _logs(apply_headloss(_trainer(kind, tmp_path, **config)))
    assert len([e for e in theirs if "loss" in e]) == 3 and len(ours) == len(theirs)
    for mine, trl_entry in zip(ours, theirs):
        assert set(mine) == {k for k in trl_entry if not k.endswith(NOT_LOGGED)}
        for name, value in mine.items():
            assert value == pytest.approx(trl_entry[name], rel=1e-5, abs=1e-5), (name, mine, trl_entry)


def test_bf16_autocast_runs_the_head_in_bf16(tmp_path, monkeypatch):
    from headloss.integrations import trl as hl_trl
    dtypes, real = [], hl_trl.preference_loss

    def spy(x, w, *args, **kwargs):
        dtypes.append((x.dtype, w.dtype))
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(hl_trl, "preference_loss", spy)
    theirs = _logs(_trainer("dpo", tmp_path, bf16=True))
    ours = _logs(apply_headloss(_trainer("dpo", tmp_path, bf16=True)))
    assert dtypes and set(dtypes) == {(torch.bfloat16, torch.bfloat16)}
    for mine, trl_entry in zip(ours, theirs):
        for name in ("loss", "eval_loss"):
            if name in mine:
                assert mine[name] == pytest.approx(trl_entry[name], rel=1e-2), name


@pytest.mark.parametrize("kind,config,option", [
    ("dpo", dict(loss_type=["aot"]), "loss_type='aot'"),
    ("dpo", dict(loss_type=["sigmoid", "bco_pair"], loss_weights=[1.0, 1.0]), "loss_type="),
    ("dpo", dict(f_divergence_type="js_divergence"), "f_divergence_type='js_divergence'"),
    ("dpo", dict(ld_alpha=0.5), "ld_alpha"),
    ("dpo", dict(use_weighting=True), "use_weighting"),
    ("kto", dict(loss_type="apo_zero_unpaired"), "loss_type='apo_zero_unpaired'"),
    ("cpo", dict(alpha=0.2), "alpha=0.2"),
])
def test_unsupported_options_are_refused(kind, config, option, tmp_path):
    trainer = _trainer(kind, tmp_path, **config)
    with pytest.raises(headloss.HeadlossValueError, match=option):
        apply_headloss(trainer)


def test_a_logit_transform_and_other_trainers_are_refused(tmp_path):
    trainer = _trainer("cpo", tmp_path)
    trainer.model.config.final_logit_softcapping = 30.0
    with pytest.raises(headloss.HeadlossValueError, match="final_logit_softcapping=30.0"):
        apply_headloss(trainer)
    with pytest.raises(headloss.HeadlossValueError, match="none of TRL's"):
        apply_headloss(object())
