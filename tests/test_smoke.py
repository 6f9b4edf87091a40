import mlx_dspark


def test_import():
    assert mlx_dspark.__doc__


def test_atomic_writes_follow_the_umask(tmp_path):
    """A file written atomically gets the mode a plain write gives it, and
    no temporary file stays behind."""
    import stat

    from mlx_dspark.utils import umask, write_text_atomic

    path = tmp_path / "calibration.json"
    write_text_atomic(path, "{}")
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask()
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]
