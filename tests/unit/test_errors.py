"""An operating-system limit (here: a full descriptor table, EMFILE) is reported as that limit with
its fix, never as a missing, corrupt or damaged file of the user's."""

import contextlib
import errno
import os
import resource

import pytest
import torch
from safetensors.torch import save_file

from fuyou.errors import SystemLimitError, error_number, os_limit_error
from fuyou.models.hf_io import CheckpointReader
from fuyou.storage import ExtentSpec, TensorSpec, TensorStore
from fuyou.storage.dirs import check_dir
from fuyou.storage.manifest import read_manifest

BLAME = ("corrupt", "damaged", "missing", "restore the run", "permissions")


@contextlib.contextmanager
def descriptor_table_full():
    """Every descriptor this process may open is taken (soft limit lowered to keep it cheap)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
        with contextlib.suppress(OSError):
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def assert_names_the_limit(err: BaseException, path: str) -> None:
    msg = str(err)
    assert isinstance(err, SystemLimitError), f"{type(err).__name__}: {msg}"
    assert path in msg and "ulimit -n" in msg and "open-file limit" in msg, msg
    assert not any(word in msg for word in BLAME), msg


def test_model_file_under_emfile_is_not_called_missing_or_corrupt(tmp_path):
    save_file({"w": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    with descriptor_table_full(), pytest.raises(Exception) as err:
        CheckpointReader(str(tmp_path))
    assert_names_the_limit(err.value, str(tmp_path / "model.safetensors"))


def test_store_read_manifest_and_directory_check_under_emfile(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    exts = [ExtentSpec("e", (TensorSpec("w", (1000,), torch.float32),))]
    with TensorStore.create([str(d)], exts) as st:
        st.write("e", torch.ones(1000)).result()
        st.commit()
        st.io.files.close_all()  # the next read must open the file
        buf = torch.empty(1000)
        with descriptor_table_full():
            read_err = st.read("e", buf).exception()
            with pytest.raises(Exception) as manifest_err:
                read_manifest(str(d))
            with pytest.raises(Exception) as dir_err:
                check_dir(str(d))
        assert_names_the_limit(read_err, str(d))
        assert_names_the_limit(manifest_err.value, str(d))
        assert_names_the_limit(dir_err.value, str(d))
        st.read("e", buf).result()  # nothing was damaged: with descriptors free again it reads fine
        assert (buf == 1).all()


def test_limits_are_recognised_through_wrappers_and_text():
    assert error_number(RuntimeError("open failed: Too many open files (os error 24)")) == errno.EMFILE
    assert error_number(ValueError("Too many open files in system")) == errno.ENFILE
    wrapped = RuntimeError("wrapper")
    wrapped.__cause__ = OSError(errno.ENOMEM, "Cannot allocate memory")
    assert "ENOMEM" in str(os_limit_error(wrapped, "mapping /x"))
    assert "fs.file-max" in str(os_limit_error(OSError(errno.ENFILE, "x"), "opening /x"))
    assert os_limit_error(OSError(errno.ENOENT, "No such file"), "opening /x") is None
