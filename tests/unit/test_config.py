"""Unit tests of lightning_pstar.config: byte parsing, validation messages, the flat keywords, mappings."""

from __future__ import annotations

import math
import warnings
from dataclasses import fields
from typing import Any

import pytest

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.config import (
    FLAT_OPTIONS,
    MAX_CHUNK_ELEMENTS,
    SUPPORTED_PRECISIONS,
    CheckpointFormat,
    ChunkConfig,
    HostMalloc,
    LossScaleConfig,
    MemoryConfig,
    MixedPrecisionConfig,
    Placement,
    PlacementConfig,
    PStarConfig,
    PStarOptions,
    UnknownOptionError,
    parse_bytes,
)


# ---- parse_bytes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (123, 123),
        ("123", 123),
        ("123B", 123),
        ("8GiB", 8 * 2**30),
        ("8gib", 8 * 2**30),
        (" 512 MiB ", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("2KB", 2000),
        ("2KiB", 2048),
        ("1TB", 10**12),
        ("1TiB", 2**40),
        ("0.5KiB", 512),
    ],
)
def test_parse_bytes_units(value: int | str, expected: int) -> None:
    assert parse_bytes(value, name="device_memory_limit") == expected


@pytest.mark.parametrize("value", [0, -1, "0", "0GiB", "0.1B"])
def test_parse_bytes_rejects_non_positive(value: int | str) -> None:
    with pytest.raises(ValueError, match=r"`host_memory_limit` must be positive"):
        parse_bytes(value, name="host_memory_limit")


@pytest.mark.parametrize("value", ["abc", "8 GiBs", "1e9", "-1GiB", "", "8 G i B"])
def test_parse_bytes_rejects_malformed_strings_with_hint(value: str) -> None:
    with pytest.raises(ValueError, match=r"`device_memory_limit` must be a byte count.*HINT: accepted units"):
        parse_bytes(value, name="device_memory_limit")


@pytest.mark.parametrize("value", [True, False])
def test_parse_bytes_rejects_bool(value: bool) -> None:
    with pytest.raises(ValueError, match=r"`limit` must be a byte count"):
        parse_bytes(value, name="limit")


@pytest.mark.parametrize("value", [1.5, None, [1]])
def test_parse_bytes_rejects_other_types(value: object) -> None:
    with pytest.raises(ValueError, match=r"`limit` must be an int or a string"):
        parse_bytes(value, name="limit")  # type: ignore[arg-type]


# ---- the nested dataclasses -----------------------------------------------------------------------------
def test_defaults_are_valid() -> None:
    cfg = PStarConfig()
    assert cfg.chunks.size == "auto"
    assert cfg.chunks.elements is None
    assert cfg.placement.policy is Placement.AUTO
    assert cfg.placement.policy in [p.value for p in Placement]
    assert cfg.memory.device_limit_bytes is None
    assert cfg.memory.host_limit_bytes is None
    assert cfg.checkpoint is CheckpointFormat.CONSOLIDATED
    assert isinstance(cfg.mixed_precision.loss_scale, LossScaleConfig)


def test_sections_accept_dicts_of_their_options() -> None:
    cfg = PStarConfig(chunks={"size": 64}, memory={"device_limit": "2MiB"}, placement={"policy": "static"})  # type: ignore[arg-type]
    assert cfg.chunks == ChunkConfig(size=64)
    assert cfg.memory.device_limit_bytes == 2 * 2**20
    assert cfg.placement.policy is Placement.STATIC
    with pytest.raises(
        UnknownOptionError, match=r"`chunks.sise` \(did you mean `chunks.size`\?\).*\['bucket_bytes', 'cpu_embedding'"
    ):
        PStarConfig(chunks={"sise": 64})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`memory` must be a MemoryConfig or a dict of its options, got 5"):
        PStarConfig(memory=5)  # type: ignore[arg-type]


def test_enums_print_their_values_and_iterate_once() -> None:
    assert [p.value for p in Placement] == ["auto", "static"]
    assert [c.value for c in CheckpointFormat] == ["consolidated", "sharded"]
    assert f"{Placement.STATIC}" == "static" and Placement.STATIC == "static"
    assert CheckpointFormat.SHARDED == "sharded"
    assert [h.value for h in HostMalloc] == ["cached", "system"] and f"{HostMalloc.SYSTEM}" == "system"


@pytest.mark.parametrize("value", [0, -5, "big", "0", "-5", 1.5, True, "", None, MAX_CHUNK_ELEMENTS + 1, 10**13])
def test_chunk_size_errors_name_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"`chunks.size` must be a positive number of elements.*or 'auto'.*HINT"):
        ChunkConfig(size=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`chunk_size` must be a positive number of elements.*or 'auto'.*HINT"):
        PStarConfig.from_flat(chunk_size=value)  # type: ignore[typeddict-item]


@pytest.mark.parametrize(
    ("value", "expected"),
    [(4096, 4096), ("4096", 4096), (" 64 ", 64), ("auto", None), (MAX_CHUNK_ELEMENTS, MAX_CHUNK_ELEMENTS)],
)
def test_chunk_size_accepts_ints_and_string_ints(value: int | str, expected: int | None) -> None:
    cfg = ChunkConfig(size=value)
    assert cfg.elements == expected
    if expected is not None:
        assert cfg.size == expected and isinstance(cfg.size, int)
    assert PStarConfig.from_flat(chunk_size=value).chunks == cfg


@pytest.mark.parametrize("value", ["auto", "nope", "STATIC", "", "lru", 1, None])
def test_placement_is_validated_against_the_enum(value: Any) -> None:
    accepted = [p.value for p in Placement]
    assert "static" in accepted
    if value in accepted:
        assert PlacementConfig(policy=value).policy == value
        assert PStarConfig.from_flat(placement=value).placement.policy == value
        return
    with pytest.raises(ValueError, match=r"`placement.policy` must be one of \[.*'static'.*\], got"):
        PlacementConfig(policy=value)
    with pytest.raises(ValueError, match=r"`placement` must be one of \[.*'static'.*\], got"):
        PStarConfig.from_flat(placement=value)


@pytest.mark.parametrize("value", ["consolidated", "sharded", "zip", "SHARDED", None])
def test_checkpoint_format_is_validated_against_the_enum(value: Any) -> None:
    if value in ("consolidated", "sharded"):
        assert PStarConfig(checkpoint=value).checkpoint is CheckpointFormat(value)
        return
    with pytest.raises(ValueError, match=r"`checkpoint` must be one of \['consolidated', 'sharded'\], got"):
        PStarConfig(checkpoint=value)


_FRACTIONS = [
    ("memory", "device_fraction", "device_memory_fraction"),
    ("memory", "host_fraction", "host_memory_fraction"),
    ("placement", "static_chunk_fraction", "static_chunk_fraction"),
    ("placement", "warmup_chunk_fraction", "warmup_chunk_fraction"),
]


@pytest.mark.parametrize(("section", "name", "flat"), _FRACTIONS)
@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.0001, 2, float("nan")])
def test_fractions_out_of_range(section: str, name: str, flat: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"`{section}.{name}` must be in \(0, 1\]"):
        PStarConfig(**{section: {name: value}})
    with pytest.raises(ValueError, match=rf"`{flat}` must be in \(0, 1\]"):
        PStarConfig.from_flat(**{flat: value})  # type: ignore[misc]


@pytest.mark.parametrize("value", [1.0, 0.5, 1e-3, 1])
def test_fractions_in_range(value: float) -> None:
    cfg = MemoryConfig(device_fraction=value, host_fraction=value)
    assert cfg.device_fraction == value and isinstance(cfg.device_fraction, float)


@pytest.mark.parametrize("name", ["device_limit", "host_limit"])
@pytest.mark.parametrize("value", ["abc", 0, -1, True, 1.5])
def test_memory_limits_validated_at_construction(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"`memory.{name}`"):
        MemoryConfig(**{name: value})


def test_memory_limit_properties_parse_units() -> None:
    cfg = MemoryConfig(device_limit="2MiB", host_limit=1000)
    assert cfg.device_limit_bytes == 2 * 2**20
    assert cfg.host_limit_bytes == 1000


# ---- one test per bad input: a ValueError naming the option, the value and what is accepted ---------------
_LS = "mixed_precision.loss_scale"
BAD_INPUTS: list[tuple[str, dict[str, Any], str]] = [
    ("flat", {"device_memory_fraction": "0.5"}, r"`device_memory_fraction` must be a number in \(0, 1\], got '0.5'"),
    ("flat", {"host_memory_fraction": None}, r"`host_memory_fraction` must be a number in \(0, 1\], got None"),
    ("flat", {"device_memory_fraction": True}, r"`device_memory_fraction` must be a number .*got True"),
    ("flat", {"static_chunk_fraction": False}, r"`static_chunk_fraction` must be a number .*got False"),
    ("flat", {"chunk_size": 10**13}, r"`chunk_size` must be a positive number of elements \(at most 2\*\*31"),
    ("flat", {"chunk_size": True}, r"`chunk_size` must be a positive number of elements"),
    ("flat", {"cpu_embedding": "yes"}, r"`cpu_embedding` must be true or false, got 'yes'"),
    ("flat", {"frozen_master": 1}, r"`frozen_master` must be true or false, got 1"),
    ("flat", {"checkpoint": "zip"}, r"`checkpoint` must be one of \['consolidated', 'sharded'\], got 'zip'"),
    ("flat", {"device_memory_limit": "lots"}, r"`device_memory_limit` must be a byte count.*'lots'"),
    ("flat", {"host_memory_limit": 0}, r"`host_memory_limit` must be positive, got 0"),
    ("flat", {"loss_scale": 1024}, r"`loss_scale` must be a LossScaleConfig or a dict of its options, got 1024"),
    ("flat", {"loss_scale": {"initial_scale": "big"}}, r"`loss_scale.initial_scale` must be a number .*got 'big'"),
    ("loss", {"initial_scale": "big"}, rf"`{_LS}.initial_scale` must be a number > 0, finite, got 'big'"),
    ("loss", {"initial_scale": math.inf}, rf"`{_LS}.initial_scale` must be > 0 and finite, got inf"),
    ("loss", {"initial_scale": True}, rf"`{_LS}.initial_scale` must be a number .*got True"),
    ("loss", {"growth_factor": math.inf}, rf"`{_LS}.growth_factor` must be > 1 and finite, got inf"),
    ("loss", {"growth_factor": None}, rf"`{_LS}.growth_factor` must be a number .*got None"),
    ("loss", {"backoff_factor": "half"}, rf"`{_LS}.backoff_factor` must be a number in \(0, 1\), got 'half'"),
    ("loss", {"growth_interval": 2.5}, rf"`{_LS}.growth_interval` must be an int >= 1 .*got 2.5"),
    ("loss", {"growth_interval": True}, rf"`{_LS}.growth_interval` must be an int >= 1 .*got True"),
    ("loss", {"growth_interval": "10"}, rf"`{_LS}.growth_interval` must be an int >= 1 .*got '10'"),
    ("loss", {"min_scale": "1"}, rf"`{_LS}.min_scale` must be a number in \(0, initial_scale\], got '1'"),
    ("nested", {"memory": {"device_fraction": "0.5"}}, r"`memory.device_fraction` must be a number .*got '0.5'"),
    ("nested", {"mixed_precision": {"frozen_master": "no"}}, r"`mixed_precision.frozen_master` must be true or"),
    ("nested", {"chunks": {"cpu_embedding": None}}, r"`chunks.cpu_embedding` must be true or false, got None"),
]


@pytest.mark.parametrize(("kind", "options", "pattern"), BAD_INPUTS, ids=[str(c[1]) for c in BAD_INPUTS])
def test_bad_input_is_a_value_error_naming_the_option(kind: str, options: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        if kind == "flat":
            PStarConfig.from_flat(**options)
        elif kind == "loss":
            LossScaleConfig(**options)
        else:
            PStarConfig(**options)


@pytest.mark.parametrize(("options", "pattern"), [(c[1], c[2]) for c in BAD_INPUTS if c[0] == "flat"])
def test_bad_strategy_keyword_fails_before_anything_is_built(options: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        PatrickStarStrategy(**options)


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("initial_scale", 0.0, rf"`{_LS}.initial_scale` must be > 0"),
        ("initial_scale", -1.0, rf"`{_LS}.initial_scale` must be > 0"),
        ("initial_scale", float("nan"), rf"`{_LS}.initial_scale` must be > 0"),
        ("growth_factor", 1.0, rf"`{_LS}.growth_factor` must be > 1"),
        ("growth_factor", 0.5, rf"`{_LS}.growth_factor` must be > 1"),
        ("backoff_factor", 0.0, rf"`{_LS}.backoff_factor` must be in \(0, 1\)"),
        ("backoff_factor", 1.0, rf"`{_LS}.backoff_factor` must be in \(0, 1\)"),
        ("growth_interval", 0, rf"`{_LS}.growth_interval` must be an int >= 1"),
        ("min_scale", 0.0, rf"`{_LS}.min_scale` must be in \(0, initial_scale="),
        ("min_scale", 2.0**17, rf"`{_LS}.min_scale` must be in \(0, initial_scale="),
    ],
)
def test_loss_scale_validation(field: str, value: float, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        LossScaleConfig(**{field: value})


def test_loss_scale_from_dict_in_mixed_precision_config() -> None:
    cfg = MixedPrecisionConfig(loss_scale={"initial_scale": 128, "growth_interval": 5})  # type: ignore[arg-type]
    assert cfg.loss_scale == LossScaleConfig(initial_scale=128.0, growth_interval=5)
    assert isinstance(cfg.loss_scale.initial_scale, float)
    with pytest.raises(ValueError, match=rf"`{_LS}.growth_factor`"):
        MixedPrecisionConfig(loss_scale={"growth_factor": 1.0})  # type: ignore[arg-type]
    assert PStarConfig.from_flat(loss_scale={"growth_interval": 5}).mixed_precision.loss_scale.growth_interval == 5
    assert PStarConfig.from_flat(loss_scale=None) == PStarConfig()


def test_loss_scale_dict_with_unknown_key_is_a_value_error_naming_the_key() -> None:
    # configuration mistakes are ValueErrors naming the field; a misspelled nested key must not
    # surface as a bare TypeError from the dataclass constructor
    with pytest.raises(ValueError, match=r"`loss_scale.growth_intervall` \(did you mean `loss_scale.growth_interval`"):
        PStarConfig.from_flat(loss_scale={"growth_intervall": 10})
    with pytest.raises(ValueError, match=rf"`{_LS}.growth_intervall`"):
        MixedPrecisionConfig(loss_scale={"growth_intervall": 10})  # type: ignore[arg-type]


def test_loss_scale_of_wrong_type_is_rejected() -> None:
    # a user passing a static scale (loss_scale=1024) must be told at construction, not crash later with an
    # AttributeError inside the precision plugin
    with pytest.raises(ValueError, match=rf"`{_LS}`"):
        MixedPrecisionConfig(loss_scale=1024)  # type: ignore[arg-type]


# ---- the flat keywords ----------------------------------------------------------------------------------
def test_flat_table_covers_the_typed_keywords_and_points_at_real_fields() -> None:
    assert set(FLAT_OPTIONS) == set(PStarOptions.__annotations__)
    for flat, path in FLAT_OPTIONS.items():
        section, _, leaf = path.partition(".")
        assert section in {f.name for f in fields(PStarConfig)}, flat
        if leaf:
            assert leaf in {f.name for f in fields(getattr(PStarConfig(), section))}, flat


def test_from_flat_builds_the_nested_config() -> None:
    cfg = PStarConfig.from_flat(
        chunk_size=4096,
        cpu_embedding=True,
        device_memory_limit="8GiB",
        host_memory_limit=1000,
        device_memory_fraction=0.5,
        host_memory_fraction=0.25,
        placement="static",
        static_chunk_fraction=0.5,
        warmup_chunk_fraction=0.125,
        frozen_master=False,
        loss_scale=LossScaleConfig(initial_scale=8.0),
        checkpoint="sharded",
    )
    assert cfg == PStarConfig(
        chunks=ChunkConfig(size=4096, cpu_embedding=True),
        memory=MemoryConfig(device_limit="8GiB", host_limit=1000, device_fraction=0.5, host_fraction=0.25),
        placement=PlacementConfig(policy=Placement.STATIC, static_chunk_fraction=0.5, warmup_chunk_fraction=0.125),
        mixed_precision=MixedPrecisionConfig(frozen_master=False, loss_scale=LossScaleConfig(initial_scale=8.0)),
        checkpoint=CheckpointFormat.SHARDED,
    )
    assert PStarConfig.from_flat() == PStarConfig()


def test_from_flat_unknown_keyword_names_the_close_match_and_the_options() -> None:
    with pytest.raises(UnknownOptionError, match=r"(?s)`chunk_sise` \(did you mean `chunk_size`\?\).*'warmup_chunk_f"):
        PStarConfig.from_flat(chunk_sise=1)  # type: ignore[call-arg]


def test_supported_precisions_have_one_home() -> None:
    from lightning_pstar import precision
    from lightning_pstar.planning import capacity

    assert precision.SUPPORTED_PRECISIONS is SUPPORTED_PRECISIONS
    assert tuple(precision._DTYPES) == SUPPORTED_PRECISIONS
    assert tuple(capacity._COMPUTE_ITEMSIZE) == SUPPORTED_PRECISIONS


# ---- the strategy's constructor -------------------------------------------------------------------------
def test_strategy_flat_keywords_build_the_nested_config() -> None:
    strategy = PatrickStarStrategy(device_memory_limit="8GiB", placement="auto", chunk_size=256)
    assert strategy.config == PStarConfig(chunks=ChunkConfig(size=256), memory=MemoryConfig(device_limit="8GiB"))
    assert PatrickStarStrategy().config == PStarConfig()


def test_strategy_refuses_config_together_with_options_naming_them() -> None:
    config = PStarConfig(chunks=ChunkConfig(size=64))
    with pytest.raises(ValueError, match=r"`config=` together with \['chunk_size', 'placement'\].*HINT"):
        PatrickStarStrategy(config=config, placement="static", chunk_size=128)
    with pytest.raises(ValueError, match=r"`config=` together with \['device_memory_limit'\]"):
        PatrickStarStrategy.from_config({"chunks": {"size": 64}}, device_memory_limit="1GiB")  # type: ignore[arg-type]
    assert PatrickStarStrategy(config=config).config is config
    assert PatrickStarStrategy.from_config(config).config is config


def test_strategy_refuses_a_config_of_the_wrong_type() -> None:
    with pytest.raises(ValueError, match=r"`config` must be a PStarConfig, got dict.*HINT: .*from_config"):
        PatrickStarStrategy(config={"chunks": {"size": 64}})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("keyword", "close"), [("chunk_sise", "chunk_size"), ("devce_memory_limit", "device_memory_limit")]
)
def test_strategy_misspelled_keyword_is_the_same_error_as_from_config(keyword: str, close: str) -> None:
    with pytest.raises(UnknownOptionError, match=rf"(?s)`{keyword}` \(did you mean `{close}`\?\).*HINT.*'placement'"):
        PatrickStarStrategy(**{keyword: 1})  # type: ignore[arg-type]
    with pytest.raises(UnknownOptionError, match=rf"`{keyword}` \(did you mean `{close}`"):
        PatrickStarStrategy.from_config({keyword: 1})
    # a ValueError like every configuration error, and a TypeError like Python's unexpected keyword
    assert issubclass(UnknownOptionError, ValueError) and issubclass(UnknownOptionError, TypeError)


def test_strategy_misspelled_lightning_argument_suggests_it() -> None:
    with pytest.raises(UnknownOptionError, match=r"(?s)`start_methd` \(did you mean `start_method`\?\).*Lightning"):
        PatrickStarStrategy(start_methd="spawn")  # type: ignore[call-arg]


def test_strategy_nested_keywords_point_at_from_config() -> None:
    with pytest.raises(UnknownOptionError, match=r"`chunks`.*HINT: .*from_config"):
        PatrickStarStrategy(chunks={"size": 64})  # type: ignore[call-arg]


# ---- from_mapping ---------------------------------------------------------------------------------------
def test_from_mapping_unknown_key_names_it() -> None:
    with pytest.raises(ValueError, match=r"(?s)Unknown PatrickStar option.*chunk_sise.*HINT: the options are"):
        PStarConfig.from_mapping({"chunk_sise": 1024})


def test_from_mapping_unknown_key_suggests_the_close_match() -> None:
    with pytest.raises(UnknownOptionError, match=r"`chunk_sise` \(did you mean `chunk_size` \(now `chunks.size`\)"):
        PStarConfig.from_mapping({"chunk_sise": 1024})
    with pytest.raises(UnknownOptionError, match=r"`memroy` \(did you mean `memory`\?\)"):
        PStarConfig.from_mapping({"memroy": {}})
    with pytest.raises(
        UnknownOptionError,
        match=r"`memory.device_limt` \(did you mean `memory.device_limit`\?\)\. HINT: the options of `memory` are",
    ):
        PStarConfig.from_mapping({"memory": {"device_limt": "1GiB"}})


def test_from_mapping_unknown_nested_key_names_it() -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"`loss_scale\.bogus`"):
        PStarConfig.from_mapping({"loss_scale": {"bogus": 1}})
    with pytest.raises(ValueError, match=rf"`{_LS}\.bogus`"):
        PStarConfig.from_mapping({"mixed_precision": {"loss_scale": {"bogus": 1}}})


def test_from_mapping_ignores_hydra_target() -> None:
    cfg = PStarConfig.from_mapping(
        {"_target_": "lightning_pstar.PatrickStarStrategy", "placement": {"policy": "static"}, "chunks": {"size": 64}}
    )
    assert cfg.chunks.size == 64
    assert cfg.placement.policy == "static"


def test_from_mapping_nested_keys_and_string_values() -> None:
    cfg = PStarConfig.from_mapping(
        {
            "chunks": {"size": "4096"},
            "memory": {"device_limit": "512MiB", "host_limit": "1073741824", "device_fraction": "0.5"},
            "mixed_precision": {"loss_scale": {"initial_scale": "1024", "growth_interval": "10"}},
            "checkpoint": "sharded",
        }
    )
    assert cfg.chunks.size == 4096
    assert cfg.chunks.elements == 4096
    assert cfg.memory.device_limit_bytes == 512 * 2**20
    assert cfg.memory.host_limit_bytes == 2**30
    assert cfg.memory.device_fraction == 0.5
    assert cfg.mixed_precision.loss_scale == LossScaleConfig(initial_scale=1024.0, growth_interval=10)
    assert cfg.checkpoint is CheckpointFormat.SHARDED


FLAT_MAPPING = {
    "chunk_size": 4096,
    "placement": "static",
    "device_memory_limit": "512MiB",
    "static_chunk_fraction": 0.5,
    "loss_scale": {"initial_scale": 1024.0},
    "frozen_master": False,
    "checkpoint": "sharded",
}


def test_from_mapping_flat_keys_still_work_with_a_deprecation_warning_naming_the_new_key() -> None:
    with pytest.warns(DeprecationWarning) as record:
        cfg = PStarConfig.from_mapping(FLAT_MAPPING)
    assert cfg == PStarConfig.from_flat(**FLAT_MAPPING)  # type: ignore[arg-type]
    messages = sorted(str(w.message) for w in record)
    for flat, nested in FLAT_OPTIONS.items():
        if flat in FLAT_MAPPING and flat != nested:
            assert any(f"`{flat}` is deprecated: write `{nested}`" in m for m in messages), (flat, messages)
    assert not any("`checkpoint`" in m for m in messages), "checkpoint kept its name: no warning"
    assert {w.filename for w in record} == {__file__}, "the warning points at the caller"


def test_from_config_flat_keys_warn_and_build_the_same_strategy() -> None:
    with pytest.warns(DeprecationWarning) as record:
        strategy = PatrickStarStrategy.from_config({"device_memory_limit": "1GiB", "placement": "static"})
    messages = [str(w.message) for w in record]
    assert any("`device_memory_limit` is deprecated: write `memory.device_limit`" in m for m in messages), messages
    assert any("`placement` is deprecated: write `placement.policy`" in m for m in messages), messages
    assert strategy.config == PatrickStarStrategy(device_memory_limit="1GiB", placement="static").config


def test_from_mapping_nested_keys_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PStarConfig.from_mapping({"placement": {"policy": "static"}, "checkpoint": "sharded"})


def test_from_mapping_flat_and_nested_key_together_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"`chunks.size` is given twice: as `chunks.size` and as `chunk_size`"):
        PStarConfig.from_mapping({"chunk_size": 64, "chunks": {"size": 128}})


def test_from_mapping_empty_gives_defaults() -> None:
    assert PStarConfig.from_mapping({}) == PStarConfig()


def test_from_mapping_accepts_omegaconf_node() -> None:
    from omegaconf import OmegaConf

    node = OmegaConf.create({"chunks": {"size": 256}, "mixed_precision": {"loss_scale": {"min_scale": 2.0}}})
    cfg = PStarConfig.from_mapping(node)
    assert cfg.chunks.size == 256
    assert cfg.mixed_precision.loss_scale.min_scale == 2.0


def test_omegaconf_structured_schema_accepts_yaml_enum_values() -> None:
    # Hydra users may register PStarConfig as a structured schema and merge YAML into it directly
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(PStarConfig)
    yaml = OmegaConf.create(
        "placement:\n  policy: static\ncheckpoint: sharded\nchunks:\n  size: 64\nmemory:\n  host_malloc: system\n"
    )
    cfg = OmegaConf.to_object(OmegaConf.merge(schema, yaml))
    assert isinstance(cfg, PStarConfig)
    assert cfg.placement.policy is Placement.STATIC and cfg.checkpoint is CheckpointFormat.SHARDED
    assert cfg.chunks.size == 64 and cfg.memory.host_malloc is HostMalloc.SYSTEM


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"chunks": {"size": 0}}, r"`chunks.size`"),
        ({"chunks": {"size": "big"}}, r"`chunks.size`"),
        ({"chunk_size": 0}, r"`chunk_size`"),
        ({"placement": {"policy": "nope"}}, r"`placement.policy` must be one of \['auto', 'static'\]"),
        ({"placement": {"policy": "STATIC"}}, r"`placement.policy` must be one of"),
        ({"placement": "nope"}, r"`placement` must be one of"),
        ({"checkpoint": "zip"}, r"`checkpoint` must be one of"),
        ({"memory": {"device_fraction": 1.5}}, r"`memory.device_fraction`"),
        ({"device_memory_fraction": 1.5}, r"`device_memory_fraction`"),
        ({"memory": {"host_limit": "lots"}}, r"`memory.host_limit`"),
        ({"mixed_precision": {"loss_scale": {"backoff_factor": 2.0}}}, rf"`{_LS}.backoff_factor`"),
        ({"loss_scale": {"backoff_factor": 2.0}}, r"`loss_scale.backoff_factor`"),
        ({"mixed_precision": {"loss_scale": {"initial_scale": "inf"}}}, rf"`{_LS}.initial_scale` must be > 0 and fin"),
        ({"mixed_precision": {"loss_scale": {"growth_interval": 2.5}}}, rf"`{_LS}.growth_interval`.*2.5"),
        ({"memory": {"device_fraction": "abc"}}, r"`memory.device_fraction`.*'abc'"),
        ({"memory": {"host_fraction": None}}, r"`memory.host_fraction`.*None"),
        ({"memory": {"device_fraction": True}}, r"`memory.device_fraction`.*True"),
        ({"chunks": 5}, r"`chunks` must be a mapping of its options, got 5"),
    ],
)
def test_from_mapping_bad_values_are_value_errors(options: dict, pattern: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ValueError, match=pattern):
            PStarConfig.from_mapping(options)


@pytest.mark.parametrize(("value", "expected"), [(0, 0), ("0", 0), (1024, 1024), ("8MiB", 8 * 2**20), ("1.5KB", 1500)])
def test_bucket_bytes_accepts_zero_and_byte_counts(value: int | str, expected: int) -> None:
    assert PStarConfig.from_flat(bucket_bytes=value).chunks.bucket_nbytes == expected
    assert PStarConfig.from_mapping({"chunks": {"bucket_bytes": value}}).chunks.bucket_nbytes == expected
    assert PStarConfig().chunks.bucket_nbytes == 4 * 2**20  # the default
