"""The loss plan's options as the Python front ends take them (LossPlan, the torch ops, headloss.jax):
term names, scalar names and the numeric options, all read from the header (_abi).

The defaults rule, the same in C, Python and JAX: every numeric option defaults to None, which
leaves the descriptor's field 0, and the library reads 0 as the option's documented default
(OPTION_DEFAULTS). An explicit 0 for a field whose 0 stands for a nonzero default is refused
(HeadlossValueError naming the option and saying what to do), rather than silently becoming that
default: z_weight=0 would otherwise mean z_weight=1e-4.
"""
from __future__ import annotations

import ctypes
import numbers

from . import _abi
from ._lib import HeadlossTypeError, HeadlossValueError, code_of, named

_DESC = _abi.hl_loss_plan_desc_t
# Python's name of each term bit (the C names' suffixes, but kl_ref for GRPO_KL_REF).
TERMS = {"ce": _abi.HL_LOSS_CE, "z": _abi.HL_LOSS_Z, "entropy": _abi.HL_LOSS_ENTROPY,
         "distill_fwd": _abi.HL_LOSS_DISTILL_FWD, "distill_rev": _abi.HL_LOSS_DISTILL_REV,
         "grpo": _abi.HL_LOSS_GRPO, "kl_ref": _abi.HL_LOSS_GRPO_KL_REF, "cispo": _abi.HL_LOSS_CISPO,
         "distill_jsd": _abi.HL_LOSS_DISTILL_JSD, "preference": _abi.HL_LOSS_PREFERENCE}
# The scalars' names in their order (hl_loss_scalar_t: the HL_LOSS_OUT_* suffixes in lower case).
SCALARS = tuple(k[len("HL_LOSS_OUT_"):].lower() for k in _abi.ENUMS["hl_loss_scalar_t"]
                if k.startswith("HL_LOSS_OUT_"))
KL_ESTIMATORS = named("HL_LOSS_KL_")            # kl_estimator: "k3", "k1", "k2"
LEVELS = named("HL_LOSS_LEVEL_")                # ratio_level, rollout_level
ROLLOUT_CORRECTIONS = named("HL_LOSS_ROLLOUT_")  # rollout_correction
GRAD_MODES = named("HL_LOSS_GRAD_")             # "none", "write", "accumulate"
PREFERENCES = named("HL_LOSS_PREF_")           # preference: "dpo", "simpo", "orpo", "cpo", "kto"
DPO_LOSS_TYPES = named("HL_LOSS_DPO_")          # pref_loss_type: TRL's loss_type names
SEQ_LOGPS = named("HL_LOSS_SEQ_LOGP_")          # pref_logp: "default", "sum", "mean"
ENUM_OPTIONS = {"kl_estimator": KL_ESTIMATORS, "ratio_level": LEVELS,
                "rollout_correction": ROLLOUT_CORRECTIONS, "rollout_level": LEVELS,
                "preference": PREFERENCES, "pref_loss_type": DPO_LOSS_TYPES, "pref_logp": SEQ_LOGPS}
FLOAT_OPTIONS = tuple(f for f, t in _DESC._fields_ if t is ctypes.c_float)  # weights, temperatures...
INT_OPTIONS = ("vocab_start", "vocab_global", "ranks", "teacher_topk")  # the shard and the teacher
PLAN_OPTIONS = FLOAT_OPTIONS + tuple(ENUM_OPTIONS) + INT_OPTIONS

# The default each option's None (the field's 0) stands for: HL_LOSS_PLAN_DESC_INIT's values, and
# in words those the macro leaves 0.
OPTION_DEFAULTS = {k: "0" for k in FLOAT_OPTIONS}
OPTION_DEFAULTS.update({k: repr(v) for k, v in _DESC._defaults_.items() if k in FLOAT_OPTIONS})
OPTION_DEFAULTS.update(
    entropy_weight="none: set it with the entropy term (negative for a bonus, e.g. -1e-3)",
    kl_ref_beta="none: set it with the kl_ref term (e.g. 1e-3 as verl, 0.04 as TRL)",
    softcap="0 (no cap)", dual_clip="0 (off)", cispo_eps_high="eps_high",
    rollout_floor="1 / rollout_cap", kl_estimator="'k3'", ratio_level="'token'",
    rollout_correction="'none'", rollout_level="'token'", preference="'dpo'",
    pref_loss_type="'sigmoid'", pref_logp="'default' (the loss's: mean for simpo, orpo, ipo)",
    pref_weight="1", pref_beta="0.1", pref_tau="0.05", pref_gamma="0 (TRL's SimPO: 0.5)",
    pref_label_smoothing="0 (exo_pair: 1e-3)", kto_desirable_weight="1", kto_undesirable_weight="1",
    vocab_start="0",
    vocab_global="vocab (not sharded)", ranks="1", teacher_topk="0 (a dense teacher, if any)")
# What to do instead of an explicit 0, for the options whose 0 is a nonzero default.
_INSTEAD_OF_ZERO = {
    "ce_weight": 'to drop cross-entropy, leave "ce" out of terms',
    "z_weight": 'to drop the z-loss, leave "z" out of terms',
    "entropy_weight": 'to drop the entropy term, leave "entropy" out of terms',
    "distill_weight": "to drop distillation, leave its term out of terms",
    "grpo_weight": 'to drop GRPO, leave "grpo" out of terms',
    "kl_ref_beta": 'to drop the KL term, leave "kl_ref" out of terms (ref_logprobs alone still '
                   "report kl_ref_mean)",
    "cispo_weight": 'to drop CISPO, leave "cispo" out of terms',
    "logit_scale": "it must be nonzero",
    "teacher_temperature": "it must be > 0",
    "student_temperature": "it must be > 0",
    "eps_low": "it must be in (0, 1)",
    "eps_high": "it must be > 0",
    "cispo_eps_high": "it must be > 0",
    "rollout_cap": "it must be > 0",
    "rollout_floor": "it must be > 0",
    "jsd_beta": 'jsd_beta must be in (0, 1]; beta 0 is forward KL: use the "distill_fwd" term',
    "vocab_global": "leave it None for an unsharded plan",
    "ranks": "it must be >= 1",
    "pref_weight": 'to drop the preference loss, leave "preference" out of terms',
    "pref_beta": "it must be > 0",
    "pref_tau": "it must be > 0",
    "kto_desirable_weight": "it must be > 0",
    "kto_undesirable_weight": "it must be > 0",
}


def terms_bits(terms) -> int:
    """The HL_LOSS_* bits of `terms`: a name of TERMS, an iterable of names, or the int itself."""
    if isinstance(terms, numbers.Integral) and not isinstance(terms, bool):
        return int(terms)
    if isinstance(terms, str):
        terms = (terms,)
    try:
        names = list(terms)
    except TypeError:
        raise HeadlossTypeError(f"terms is {terms!r}; expected a name or names of {', '.join(TERMS)}") from None
    bits = 0
    for t in names:
        if t not in TERMS:
            raise HeadlossValueError(f"terms: unknown term {t!r}; the terms are {', '.join(TERMS)}")
        bits |= TERMS[t]
    return bits


def terms_key(terms):
    """terms as a hashable cache key (a name, an int, or a tuple of names)."""
    return terms if isinstance(terms, (str, numbers.Integral)) else tuple(terms)


def plan_fields(options: dict) -> dict:
    """hl_loss_plan_desc_t fields of the PLAN_OPTIONS given (None: not given, the field stays 0,
    the library's default); enum options by name (or int). HeadlossError for an unknown option, a
    value of the wrong kind, or an explicit 0 that the library would read as a nonzero default."""
    fields = {}
    for k, v in options.items():
        if v is None:
            continue
        if k in ENUM_OPTIONS:
            fields[k] = code_of(ENUM_OPTIONS[k], k, v)
            continue
        if k not in PLAN_OPTIONS:
            raise HeadlossTypeError(f"unknown loss plan option {k!r}; the numeric options are "
                                    f"{', '.join(PLAN_OPTIONS)} (help(headloss.LossPlan) lists them all)")
        kind = float if k in FLOAT_OPTIONS else int
        if isinstance(v, bool) or not isinstance(v, numbers.Real if kind is float else numbers.Integral):
            raise HeadlossTypeError(f"{k} is {v!r}; expected {'a number' if kind is float else 'an int'} or None")
        if v == 0 and k in _INSTEAD_OF_ZERO:
            raise _zero_refused(k, OPTION_DEFAULTS[k], _INSTEAD_OF_ZERO[k])
        fields[k] = kind(v)
    return fields


# A call's arguments whose 0 is a default: (that default, what to do instead of 0).
_CALL_ZERO = {"divisor": ("the sum of the valid rows' weights", "pass a positive D"),
              "grad_scale": ("1", "for no gradient make the plan with grad=None")}


def call_value(name: str, value) -> float:
    """hl_loss_args_t.divisor / grad_scale of a call's argument: None is 0, the library's default;
    an explicit 0 is refused as plan_fields refuses one."""
    if value is None:
        return 0.0
    if value == 0:
        raise _zero_refused(name, *_CALL_ZERO[name])
    return float(value)


def temperature_scale(temperature: float):
    """The logit_scale option of a sampling temperature (the per-token outputs' frontends): None
    at 1, the library's default."""
    if not temperature > 0:
        raise HeadlossValueError(f"temperature is {temperature!r}; must be > 0")
    return None if temperature == 1 else 1.0 / temperature


def _zero_refused(name: str, default: str, instead: str) -> HeadlossValueError:
    return HeadlossValueError(f"{name}=0 is refused: the library reads 0 as its default ({default}), "
                              f"which None gives; {instead}")


def describe_options() -> str:
    """The options and their defaults, one a line, for docstrings."""
    return "\n".join(f"      {k}: default {OPTION_DEFAULTS[k]}" for k in PLAN_OPTIONS)


# The preference front ends' (torch_preference, jax): TRL's names of the preference term's scalars,
# and the plan options of a preference_loss call.
PREFERENCE_METRICS = {"rewards/chosen": "rewards_chosen", "rewards/rejected": "rewards_rejected",
                      "rewards/accuracies": "rewards_accuracy", "rewards/margins": "rewards_margin",
                      "logps/chosen": "logps_chosen", "logps/rejected": "logps_rejected", "nll_loss": "ce",
                      "log_odds_ratio": "log_odds_ratio", "log_odds_chosen": "log_odds_chosen", "kl": "kto_kl"}


def preference_options(loss: str, loss_type: str, beta: float, gamma, label_smoothing: float,
                       nll_weight: float) -> dict:
    """The plan options (terms included) of preference_loss's arguments: loss_type for DPO and CPO,
    SimPO's gamma (None: 0.5, TRL's), and CE weighted by nll_weight when it is set."""
    opts = dict(preference=loss, pref_beta=beta, terms=("ce", "preference") if nll_weight else ("preference",))
    if loss in ("dpo", "cpo"):
        opts["pref_loss_type"] = loss_type
    if loss == "simpo":
        opts["pref_gamma"] = 0.5 if gamma is None else gamma
    if label_smoothing:
        opts["pref_label_smoothing"] = label_smoothing
    if nll_weight:
        opts["ce_weight"] = nll_weight
    return opts
