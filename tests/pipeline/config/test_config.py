from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.config import ConfigError, RunConfig, hash_view, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert {p.name for p in CONFIGS} >= {"smoke.yaml", "demo.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    mc = cfg.model_config()
    assert mc.vocab_size == cfg.tokenizer.vocab_size
    assert cfg.tokenize.seq_len <= mc.max_seq_len


def test_defaults_yaml_and_overrides_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 7\noptimizer:\n  lr: 0.01\nmodel:\n  preset: debug_dense\n  n_layers: 3\n")
    cfg = load_config(f, ["train.steps=9", "data.train_paths=[a.txt, b.txt]", "model.d_model=96"])
    assert cfg.train.steps == 9  # override beats YAML
    assert cfg.optimizer.lr == 0.01  # YAML beats default
    assert cfg.train.zero_stage == 1  # default
    assert cfg.data.train_paths == ["a.txt", "b.txt"]
    mc = cfg.model_config()
    assert (mc.n_layers, mc.d_model) == (3, 96)  # YAML and override beat the preset


def test_model_arch_mamba_from_yaml_and_overrides():
    mc = load_config(None, ["model.preset=debug_mamba", "model.ssm_state_size=8"]).model_config()
    assert (mc.arch, mc.d_model, mc.ssm_state_size, mc.vocab_size) == ("mamba", 64, 8, 512)
    # A Transformer preset's RoPE under arch mamba would be silently unused: refused, naming the field.
    with pytest.raises(ConfigError, match=r"model: pos_encoding must be 'none' when arch is 'mamba'.*debug_mamba"):
        load_config(None, ["model.arch=mamba"]).model_config()
    with pytest.raises(ConfigError, match=r"model: arch must be one of \['decoder', 'mamba', 'mamba2', 'hybrid', 'encoder_decoder'\], got 'rnn'"):
        load_config(None, ["model.arch=rnn"]).model_config()


def test_unknown_key_names_it_and_suggests(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  stpes: 7\n")
    with pytest.raises(ConfigError, match=r"unknown key train\.'stpes'; did you mean 'steps'\?") as e:
        load_config(f)
    assert str(f) in str(e.value)
    with pytest.raises(ConfigError, match=r"unknown key 'trian'; did you mean 'train'"):
        load_config(None, ["trian.steps=3"])
    with pytest.raises(ConfigError, match=r"unknown key model\.'n_layer'; did you mean 'n_layers'"):
        load_config(None, ["model.n_layer=3"])


@pytest.mark.parametrize("override,pattern", [
    ("train.zero_stage=5", r"train\.zero_stage=5 is not allowed; choose one of \[0, 1, 2, 3\]"),
    ("train.steps=abc", r"train\.steps must be an integer, got 'abc'"),
    ("train.steps=0", r"train\.steps=0 must be >= 1"),
    ("tokenizer.model_type=wordpiece", r"tokenizer\.model_type='wordpiece' is not allowed; choose one of \['bpe', 'unigram'\]"),
    ("model.preset=huge", r"model\.preset='huge' is not a preset; choose one of"),
    ("train.global_batch_size=10", r"train\.global_batch_size=10 must be a multiple of parallel\.num_workers=2 x"),
    ("parallel.ep_size=2", r"parallel\.ep_size=2 needs an MoE model"),
    ("tokenize.seq_len=4096", r"tokenize\.seq_len=4096 exceeds the model's max_seq_len"),
    ("model.preset=debug_moe parallel.ep_size=2 train.zero_stage=3", r"train\.zero_stage=3 with parallel\.ep_size=2"),
    ("model.preset=debug_moe parallel.ep_size=2 model.num_experts=3", r"parallel\.ep_size=2 must divide model\.num_experts=3"),
    ("model.pos_encoding=spiral", r"pos_encoding"),
    ("train.compile=true train.zero_stage=3", r"train\.compile=true with train\.zero_stage=3 is not supported"),
    ("train.precision=fp8", r"train\.precision='fp8' is not allowed; choose one of \['auto', 'fp32', 'bf16', 'fp16', 'amp_bf16'\]"),
    ("tokenize.engine=spark", r"tokenize\.engine='spark' is not allowed"),
    ("train.steps=10 optimizer.warmup_steps=10", r"optimizer\.schedule=cosine decays after warmup, so optimizer\.warmup_steps=10 must be below train\.steps=10"),
    ("data.validation_fraction=1.5", r"data\.validation_fraction=1\.5 must be in \(0, 1\)"),
    # the ranges of pipeline.config.ranges: each fails at load, not stages later
    ("train.global_batch_size=0", r"train\.global_batch_size=0 must be >= 1"),
    ("run.lock_wait_s=-1", r"run\.lock_wait_s=-1\.0 must be >= 0"),
    ("run.name=it's", r"run\.name=\"it's\" must be non-empty, without quotes or backslashes"),
    ("train.global_batch_size=-8", r"train\.global_batch_size=-8 must be >= 1"),
    ("optimizer.min_lr_ratio=1.5", r"optimizer\.min_lr_ratio=1\.5 must be in \[0, 1\]"),
    ("optimizer.weight_decay=-0.1", r"optimizer\.weight_decay=-0\.1 must be >= 0"),
    ("optimizer.beta1=1.0", r"optimizer\.beta1=1\.0 must be in \[0, 1\)"),
    ("optimizer.beta2=-0.5", r"optimizer\.beta2=-0\.5 must be in \[0, 1\)"),
    ("optimizer.adam_eps=0", r"optimizer\.adam_eps=0\.0 must be > 0"),
    ("optimizer.grad_clip=-1", r"optimizer\.grad_clip=-1\.0 must be >= 0"),
    ("tokenizer.num_threads=0", r"tokenizer\.num_threads=0 must be >= 1"),
    ("tokenizer.max_training_bytes=0", r"tokenizer\.max_training_bytes=0 must be >= 1"),
    ("parallel.threads_per_worker=0", r"parallel\.threads_per_worker=0 must be >= 1"),
    ("eval.max_batches=0", r"eval\.max_batches=0 must be >= 1"),
    ("eval.batch_size=-1", r"eval\.batch_size=-1 must be >= 1"),
    ("eval.prompts=['ok','']", r"eval\.prompts=\['ok', ''\] must be a list of non-empty strings"),
    ("eval.max_new_tokens=0", r"eval\.max_new_tokens=0 must be >= 1"),
    ("eval.temperature=-0.5", r"eval\.temperature=-0\.5 must be >= 0"),
    ("eval.heldout_paths=['']", r"eval\.heldout_paths=\[''\] must be a list of non-empty strings"),
    ("eval.max_text_tokens=0", r"eval\.max_text_tokens=0 must be >= 1"),
    ("eval.lambada_max_examples=0", r"eval\.lambada_max_examples=0 must be >= 1"),
    ("eval.attention_sentence=''", r"eval\.attention_sentence='' must be non-empty"),
    ("cluster.num_cpus=0", r"cluster\.num_cpus=0 must be >= 1"),
    ("eval.context_lengths=[1]", r"eval\.context_lengths=\[1\] must be whole numbers >= 2"),
    ("eval.context_lengths=[64,999999]", r"eval\.context_lengths \[999999\] exceed the model's max_seq_len=128"),
    ("eval.context_lengths=[64] eval.heldout_paths=[]", r"eval\.context_lengths scores the held-out text"),
    ("train.init_from=models:/m@champion", r"train\.init_from='models:/m@champion' must be models:/NAME/VERSION"),
    ("model.rope_scaling_type=yarn model.rope_scaling=4", r"model: rope_scaling_type 'yarn' needs "
                                                          r"rope_original_max_seq_len"),
])
def test_bad_values_name_the_field(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, override.split())


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")
    f = tmp_path / "bad.yaml"
    f.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)
    with pytest.raises(ConfigError, match="must look like section.field=value"):
        load_config(None, ["train.steps"])


def test_round_trip_through_dict():
    from pipeline.config import config_from_dict

    cfg = load_config(None, ["train.steps=30", "model.n_layers=1"])
    assert config_from_dict(cfg.to_dict()) == cfg


def test_hash_view_drops_logging_fields():
    a = load_config(None, ["train.log_every=1"])
    b = load_config(None, ["train.log_every=50", "train.progress_bar=false"])
    assert hash_view(a.train) == hash_view(b.train)
    assert "log_every" not in hash_view(a.train)
    assert hash_view(a.train) != hash_view(load_config(None, ["train.steps=21"]).train)


def test_numbers_load_as_people_write_them(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optimizer:\n  lr: 3e-4\n  adam_eps: 1E-8\n  warmup_steps: 10\ntrain:\n  steps: 1e2\n"
                 "model:\n  rope_base: 1e4\n")
    cfg = load_config(f)
    assert (cfg.optimizer.lr, cfg.optimizer.adam_eps, cfg.train.steps) == (3e-4, 1e-8, 100)
    assert isinstance(cfg.train.steps, int)
    assert cfg.model_config().rope_base == 1e4
    cfg = load_config(None, ["optimizer.lr=3e-4", "optimizer.beta2=+9.9e-1", "train.steps=2e1"])
    assert (cfg.optimizer.lr, cfg.optimizer.beta2, cfg.train.steps) == (3e-4, 0.99, 20)
    with pytest.raises(ConfigError, match=r"train\.steps must be an integer, got 2\.5"):
        load_config(None, ["train.steps=2.5"])
    with pytest.raises(ConfigError, match=r"optimizer\.lr must be a finite number, got inf"):
        load_config(None, ["optimizer.lr=.inf"])
    assert load_config(None, ["run.name=1e3x"]).run.name == "1e3x"  # not a number: stays a string


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
@pytest.mark.parametrize("field,refusal", [
    ("optimizer.lr", r"optimizer\.lr must be a finite number"),  # a float field
    ("train.steps", r"train\.steps must be an integer"),  # an integer field
    ("model.rope_base", r"model: rope_base must be a finite number"),  # a ModelConfig field
])
def test_nan_and_infinities_are_refused_naming_the_field(tmp_path, value, field, refusal):
    """YAML reads ``.nan``, ``.inf`` and ``-.inf`` as floats: each is refused, in the file and in an
    override, naming the field and what was found (rather than training on a NaN learning rate)."""
    section, name = field.split(".")
    f = tmp_path / "c.yaml"
    f.write_text(f"{section}:\n  {name}: {value}\n")
    found = {".nan": "nan", ".inf": "inf", "-.inf": "-inf"}[value]
    with pytest.raises(ConfigError, match=rf"{refusal}, got {found}$"):
        load_config(f)
    with pytest.raises(ConfigError, match=rf"{refusal}, got {found}$"):
        load_config(None, [f"{field}={value}"])


def test_a_key_given_twice_names_both_lines(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 7\nparallel:\n  num_workers: 1\ntrain:\n  log_every: 7\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: key 'train' is given twice in one mapping \(lines 1 and 5\)"):
        load_config(f)
    f.write_text("train:\n  steps: 7\n  steps: 8\n")
    with pytest.raises(ConfigError, match=r"key 'steps' is given twice in one mapping \(lines 2 and 3\)"):
        load_config(f)
    with pytest.raises(ConfigError, match=r"override 'data\.train_paths=\{a: 1, a: 2\}'.*given twice"):
        load_config(None, ["data.train_paths={a: 1, a: 2}"])


def test_every_range_names_a_real_field():
    from pipeline.config.ranges import RANGES

    cfg = RunConfig()
    for path in RANGES:
        section, name = path.split(".")
        assert hasattr(getattr(cfg, section), name), path


def test_register_alias_champion_is_refused():
    with pytest.raises(ConfigError, match=r"register\.alias=champion would skip the promotion gates.*jobs\.promote"):
        load_config(None, ["register.alias=champion"])
    assert load_config(None, ["register.alias=candidate"]).register.alias == "candidate"


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n  # and another\n"])
def test_an_empty_config_file_is_refused_saying_so(tmp_path, text):
    """An empty file used to run the whole pipeline on the defaults without a word."""
    f = tmp_path / "empty.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=r"empty\.yaml: the config is empty \(nothing but blank lines or comments\)"):
        load_config(f)
    with pytest.raises(ConfigError, match="the config is empty"):
        load_config(f, ["train.steps=3"])  # overrides alone do not make a file a config


@pytest.mark.parametrize("old,new", [("lr", "optimizer.lr"), ("warmup_steps", "optimizer.warmup_steps"),
                                     ("eval_every", "validation.every"), ("checkpoint_every", "checkpoint.every"),
                                     ("checkpoint_storage", "checkpoint.storage"), ("resume_from", "checkpoint.resume_from")])
def test_a_key_that_left_the_train_section_names_its_new_place(tmp_path, old, new):
    """train held 30 fields; the optimizer and its schedule, validation and checkpoints are sections of
    their own now, and a config written for the old layout is told where each key went."""
    f = tmp_path / "old.yaml"
    f.write_text(f"train:\n  steps: 7\n  {old}: 10\n")
    with pytest.raises(ConfigError, match=rf"old\.yaml: train\.{old} has moved: it is {re.escape(new)} now"):
        load_config(f)
    with pytest.raises(ConfigError, match=rf"train\.{old} has moved: it is {re.escape(new)} now"):
        load_config(None, [f"train.{old}=10"])
