"""Unit tests of lightning_pstar.config: byte parsing, validation messages, building from mappings."""

from __future__ import annotations

import pytest

from lightning_pstar.config import LossScaleConfig, Placement, PStarConfig, parse_bytes


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


# ---- PStarConfig validation -----------------------------------------------------------------------------
def test_defaults_are_valid() -> None:
    cfg = PStarConfig()
    assert cfg.chunk_size == "auto"
    assert cfg.chunk_elements is None
    assert cfg.placement in [p.value for p in Placement]
    assert cfg.device_limit_bytes is None
    assert cfg.host_limit_bytes is None
    assert isinstance(cfg.loss_scale, LossScaleConfig)


@pytest.mark.parametrize("value", [0, -5, "big", "0", "-5", 1.5, True, "", None])
def test_chunk_size_errors_name_the_field(value: object) -> None:
    with pytest.raises(ValueError, match=r"`chunk_size` must be a positive number of elements or 'auto'.*HINT"):
        PStarConfig(chunk_size=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "expected"), [(4096, 4096), ("4096", 4096), (" 64 ", 64), ("auto", None)])
def test_chunk_size_accepts_ints_and_string_ints(value: int | str, expected: int | None) -> None:
    cfg = PStarConfig(chunk_size=value)
    assert cfg.chunk_elements == expected
    if expected is not None:
        assert cfg.chunk_size == expected and isinstance(cfg.chunk_size, int)


@pytest.mark.parametrize("value", ["auto", "nope", "STATIC", "", "lru"])
def test_placement_is_validated_against_the_enum(value: str) -> None:
    accepted = [p.value for p in Placement]
    assert "static" in accepted
    if value in accepted:
        assert PStarConfig(placement=value).placement == value
        return
    with pytest.raises(ValueError, match=r"`placement` must be one of \[.*'static'.*\], got"):
        PStarConfig(placement=value)


@pytest.mark.parametrize("name", ["device_memory_fraction", "host_memory_fraction"])
@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.0001, 2, float("nan")])
def test_fractions_out_of_range(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"`{name}` must be in \(0, 1\]"):
        PStarConfig(**{name: value})


@pytest.mark.parametrize("value", [1.0, 0.5, 1e-3])
def test_fractions_in_range(value: float) -> None:
    cfg = PStarConfig(device_memory_fraction=value, host_memory_fraction=value)
    assert cfg.device_memory_fraction == value


@pytest.mark.parametrize("name", ["device_memory_limit", "host_memory_limit"])
@pytest.mark.parametrize("value", ["abc", 0, -1, True])
def test_memory_limits_validated_at_construction(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"`{name}`"):
        PStarConfig(**{name: value})


def test_memory_limit_properties_parse_units() -> None:
    cfg = PStarConfig(device_memory_limit="2MiB", host_memory_limit=1000)
    assert cfg.device_limit_bytes == 2 * 2**20
    assert cfg.host_limit_bytes == 1000


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [
        ("initial_scale", 0.0, r"`loss_scale.initial_scale` must be > 0"),
        ("initial_scale", -1.0, r"`loss_scale.initial_scale` must be > 0"),
        ("initial_scale", float("nan"), r"`loss_scale.initial_scale` must be > 0"),
        ("growth_factor", 1.0, r"`loss_scale.growth_factor` must be > 1"),
        ("growth_factor", 0.5, r"`loss_scale.growth_factor` must be > 1"),
        ("backoff_factor", 0.0, r"`loss_scale.backoff_factor` must be in \(0, 1\)"),
        ("backoff_factor", 1.0, r"`loss_scale.backoff_factor` must be in \(0, 1\)"),
        ("growth_interval", 0, r"`loss_scale.growth_interval` must be >= 1"),
        ("min_scale", 0.0, r"`loss_scale.min_scale` must be in \(0, initial_scale="),
        ("min_scale", 2.0**17, r"`loss_scale.min_scale` must be in \(0, initial_scale="),
    ],
)
def test_loss_scale_validation(field: str, value: float, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        LossScaleConfig(**{field: value})


def test_loss_scale_from_dict_in_pstar_config() -> None:
    cfg = PStarConfig(loss_scale={"initial_scale": 128.0, "growth_interval": 5})  # type: ignore[arg-type]
    assert isinstance(cfg.loss_scale, LossScaleConfig)
    assert cfg.loss_scale.initial_scale == 128.0
    assert cfg.loss_scale.growth_interval == 5
    with pytest.raises(ValueError, match=r"`loss_scale.growth_factor`"):
        PStarConfig(loss_scale={"growth_factor": 1.0})  # type: ignore[arg-type]


def test_loss_scale_dict_with_unknown_key_is_a_value_error_naming_the_key() -> None:
    # configuration mistakes are ValueErrors naming the field; a misspelled nested key must not
    # surface as a bare TypeError from the dataclass constructor
    with pytest.raises(ValueError, match=r"growth_intervall"):
        PStarConfig(loss_scale={"growth_intervall": 10})  # type: ignore[arg-type]


def test_loss_scale_of_wrong_type_is_rejected() -> None:
    # a user passing a static scale (loss_scale=1024) must be told at construction, not crash later with an
    # AttributeError inside the precision plugin
    with pytest.raises(ValueError, match=r"`loss_scale`"):
        PStarConfig(loss_scale=1024)  # type: ignore[arg-type]


# ---- from_mapping ---------------------------------------------------------------------------------------
def test_from_mapping_unknown_key_names_it() -> None:
    with pytest.raises(ValueError, match=r"(?s)Unknown PatrickStar option.*chunk_sise.*HINT: the options are"):
        PStarConfig.from_mapping({"chunk_sise": 1024})


def test_from_mapping_unknown_nested_key_names_it() -> None:
    with pytest.raises(ValueError, match=r"loss_scale\.bogus"):
        PStarConfig.from_mapping({"loss_scale": {"bogus": 1}})


def test_from_mapping_ignores_hydra_target() -> None:
    cfg = PStarConfig.from_mapping(
        {"_target_": "lightning_pstar.PatrickStarStrategy.from_config", "placement": "static", "chunk_size": 64}
    )
    assert cfg.chunk_size == 64
    assert cfg.placement == "static"


def test_from_mapping_nested_loss_scale_and_string_ints() -> None:
    cfg = PStarConfig.from_mapping(
        {
            "chunk_size": "4096",
            "device_memory_limit": "512MiB",
            "host_memory_limit": "1073741824",
            "loss_scale": {"initial_scale": "1024", "growth_interval": "10"},
        }
    )
    assert cfg.chunk_size == 4096
    assert cfg.chunk_elements == 4096
    assert cfg.device_limit_bytes == 512 * 2**20
    assert cfg.host_limit_bytes == 2**30
    assert isinstance(cfg.loss_scale, LossScaleConfig)
    assert cfg.loss_scale.initial_scale == 1024.0
    assert cfg.loss_scale.growth_interval == 10


def test_from_mapping_empty_gives_defaults() -> None:
    assert PStarConfig.from_mapping({}) == PStarConfig()


def test_from_mapping_accepts_omegaconf_node() -> None:
    from omegaconf import OmegaConf

    node = OmegaConf.create({"chunk_size": 256, "loss_scale": {"min_scale": 2.0}})
    cfg = PStarConfig.from_mapping(node)
    assert cfg.chunk_size == 256
    assert cfg.loss_scale.min_scale == 2.0


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"chunk_size": 0}, r"`chunk_size`"),
        ({"chunk_size": "big"}, r"`chunk_size`"),
        ({"placement": "nope"}, r"`placement`"),
        ({"device_memory_fraction": 1.5}, r"`device_memory_fraction`"),
        ({"host_memory_limit": "lots"}, r"`host_memory_limit`"),
        ({"loss_scale": {"backoff_factor": 2.0}}, r"`loss_scale.backoff_factor`"),
        ({"device_memory_fraction": "abc"}, r"device_memory_fraction"),
    ],
)
def test_from_mapping_bad_values_are_value_errors(options: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        PStarConfig.from_mapping(options)
