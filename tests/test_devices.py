"""Device, precision and process choices, on simulated machines.

No GPU and no Mac ever run these tests: they monkeypatch what torch reports
(`torch.cuda.is_available`, `device_count`, `get_device_capability`,
`torch.backends.mps.is_available`) and the calls that would need the
hardware (`set_device`, `init_process_group`, DDP, moving a model), and
check each decision for five machines: no GPU, one T4, one A100, two A100s
under torchrun, and a Mac. The last tests train for real, on this CPU.
"""

import argparse
import multiprocessing
import sys
import time
import warnings

import pytest
import torch

import annotated_transformer_tools as tools
import the_annotated_transformer as tat

CUDA = torch.device("cuda")


class Machine:
    """What torch reports on one simulated machine, and what was called."""

    def __init__(self, gpus=0, capability=(8, 0), mps=False, cpu_bf16=False):
        self.gpus, self.capability = gpus, capability
        self.mps, self.cpu_bf16 = mps, cpu_bf16
        self.set_device, self.groups, self.ddp_ids = [], [], []
        self.destroyed = 0

    def install(self, monkeypatch):
        """Make torch (and the CPU flags) report this machine."""
        monkeypatch.delenv("AT_DEVICE", raising=False)  # no override
        monkeypatch.delenv("AT_PRECISION", raising=False)
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: self.gpus > 0)
        monkeypatch.setattr(cuda, "device_count", lambda: self.gpus)
        monkeypatch.setattr(
            cuda, "get_device_capability", lambda d=None: self.capability
        )
        monkeypatch.setattr(cuda, "get_device_name", lambda d=None: "GPU")
        monkeypatch.setattr(cuda, "set_device", self.choose_gpu)
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(
            torch.backends.mps, "is_available", lambda: self.mps
        )
        monkeypatch.setattr(
            tools, "cpu_has_native_bf16", lambda: self.cpu_bf16, raising=False
        )
        dist = torch.distributed
        monkeypatch.setattr(dist, "init_process_group", self.init_group)
        monkeypatch.setattr(dist, "is_initialized", lambda: bool(self.groups))
        monkeypatch.setattr(dist, "destroy_process_group", self.destroy)
        monkeypatch.setattr(
            torch.nn.parallel, "DistributedDataParallel", self.ddp
        )
        return self

    def choose_gpu(self, device):
        """torch.cuda.set_device, which refuses a "cuda" with no number."""
        if isinstance(device, (str, torch.device)):
            if torch.device(device).index is None:
                raise ValueError(f"Expected a specified index, got {device}")
        self.set_device.append(device)

    def init_group(self, backend, init_method=None, **kwargs):
        self.groups.append({"backend": backend, "url": init_method, **kwargs})

    def destroy(self):
        self.destroyed += 1

    def ddp(self, module, device_ids=None):
        self.ddp_ids.append(device_ids)
        return module


MACHINES = {
    "no GPU": dict(),
    "no GPU, AMX CPU": dict(cpu_bf16=True),
    "one T4": dict(gpus=1, capability=(7, 5)),
    "one A100": dict(gpus=1, capability=(8, 0)),
    "one P100": dict(gpus=1, capability=(6, 0)),
    "one GTX 1080": dict(gpus=1, capability=(6, 1)),
    "two A100s": dict(gpus=2, capability=(8, 0)),
    "a Mac": dict(mps=True),
}


@pytest.fixture
def machine(monkeypatch, request):
    return Machine(**MACHINES[request.param]).install(monkeypatch)


@pytest.fixture
def cpu_model(monkeypatch):
    """model_from_config builds a tiny CPU model that ignores `.to(device)`,
    so that a run "on a GPU" can be set up here."""
    moved = []

    def tiny(config, n_src, n_tgt, dropout=None):
        torch.manual_seed(0)
        model = tat.make_model(n_src, n_tgt, N=1, d_model=16, d_ff=32, h=2)
        model.to = lambda device: moved.append(torch.device(device)) or model
        return model

    monkeypatch.setattr(tat, "model_from_config", tiny)
    monkeypatch.setattr(tools, "model_from_config", tiny)
    return moved


def with_machine(*names):
    return pytest.mark.parametrize("machine", names, indirect=True)


# ------------------------------------------------------------ the device
@pytest.mark.parametrize(
    "machine, expected",
    [
        ("no GPU", "cpu"),
        ("one T4", "cuda"),
        ("one A100", "cuda"),
        ("two A100s", "cuda"),
        ("a Mac", "mps"),
    ],
    indirect=["machine"],
)
def test_pick_device_prefers_cuda_then_mps_then_cpu(machine, expected):
    assert tat.pick_device().type == expected


@with_machine("a Mac")
def test_at_device_overrides_every_choice_of_a_device(machine, monkeypatch):
    """AT_DEVICE=cpu is the way out when an operation fails on MPS. Only
    notebook 03's cell read it: Parts 4 and 5, the appendix and `--device
    auto` still trained on MPS."""
    monkeypatch.delenv("AT_DEVICE", raising=False)
    assert tat.pick_device() == torch.device("mps")
    monkeypatch.setenv("AT_DEVICE", "cpu")
    cpu = torch.device("cpu")
    assert tat.pick_device() == cpu
    assert tools.process_device(0, 1) == cpu  # find_or_train's run
    assert tools.place_process(0, 1, False) == cpu
    assert tools.checked_device("auto") == cpu  # the command line
    assert tools.checked_device("mps") == torch.device("mps")  # as asked


@with_machine("two A100s")
def test_at_device_reaches_a_lone_process_on_a_gpu_machine(
    machine, monkeypatch
):
    monkeypatch.setenv("AT_DEVICE", "cpu")
    assert tools.process_device(0, 1) == torch.device("cpu")
    assert tools.checked_device(None) == torch.device("cpu")


@pytest.mark.parametrize(
    "machine, named",
    [("no GPU", "cuda"), ("a Mac", "cuda"), ("one T4", "cuda:1")],
    indirect=["machine"],
)
def test_an_at_device_the_machine_lacks_is_one_line_before_training(
    machine, named, monkeypatch, capsys, tmp_path
):
    """`AT_DEVICE=cuda` on a Mac reached torch.cuda unchecked: train
    failed with "Torch not compiled with CUDA enabled" and a traceback."""
    monkeypatch.setenv("AT_DEVICE", named)
    message = f"AT_DEVICE={named}: no {named} here"
    with pytest.raises(ValueError, match=f"^{message}"):
        tat.pick_device()
    with pytest.raises(ValueError, match=f"^{message}"):
        tools.place_process(0, 1, False)
    folder = ["--checkpoint-dir", str(tmp_path / "ck")]
    status = tools.main(["train", "--preset", "ci", *folder])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(f"error: {message}")
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "ck").exists()  # refused before anything


@pytest.mark.parametrize(
    "machine, named",
    [("no GPU", "cuda"), ("no GPU", "cpu:1")],
    indirect=["machine"],
)
def test_several_processes_check_at_device_too(
    machine, named, monkeypatch, capsys, tmp_path
):
    """With --world-size 2, a bad AT_DEVICE was ignored without a word;
    `cpu:1` was taken by train and refused by translate."""
    monkeypatch.setenv("AT_DEVICE", named)
    folder = ["--checkpoint-dir", str(tmp_path / "ck")]
    status = tools.main(
        ["train", "--preset", "ci", "--world-size", "2", *folder]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith(f"error: AT_DEVICE={named}: no {named} here")


@with_machine("no GPU")
def test_a_torchrun_process_checks_at_device_before_anything(
    machine, monkeypatch, capsys, tmp_path
):
    """Under torchrun the check came after the download, the lock (which
    made the folder) and the vocabularies, in every rank."""
    ranks = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    for name, value in ranks.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AT_DEVICE", "cuda")
    folder = tmp_path / "ck"
    status = tools.main(
        ["train", "--preset", "ci", "--checkpoint-dir", str(folder)]
    )
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("error: AT_DEVICE=cuda: no cuda")
    assert not folder.exists()


@with_machine("two A100s")
def test_at_device_cpu_puts_several_processes_on_the_cpu(machine, monkeypatch):
    """AT_DEVICE=cpu moved one process off the GPUs but not several."""
    assert tools.process_device(1, 2) == torch.device("cuda", 1)
    monkeypatch.setenv("AT_DEVICE", "cpu")
    got = [tools.process_device(rank, 2) for rank in (0, 1)]
    assert got == [torch.device("cpu")] * 2


@with_machine("no GPU")
def test_a_wrong_at_device_is_not_blamed_on_the_device_option(
    machine, monkeypatch, capsys
):
    monkeypatch.setenv("AT_DEVICE", "gpu")
    status = tools.main(["translate", "Hallo."])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("error: AT_DEVICE='gpu' is not a device")
    assert "--device" not in err


@with_machine("one A100")
def test_an_empty_at_device_means_unset(machine, monkeypatch):
    """`AT_DEVICE= make notebook` clears it, as CUDA_VISIBLE_DEVICES= does
    not (that one hides every GPU): pick_device chooses as without it."""
    monkeypatch.setenv("AT_DEVICE", "")
    assert tat.pick_device() == torch.device("cuda")
    assert tools.process_device(0, 1).type == "cuda"
    assert tools.checked_device("auto") == torch.device("cuda")


@with_machine("no GPU")
def test_a_wrong_at_device_is_one_line(machine, monkeypatch, capsys):
    monkeypatch.setenv("AT_DEVICE", "gpu")
    with pytest.raises(ValueError, match="^AT_DEVICE='gpu' is not a device"):
        tat.pick_device()
    monkeypatch.setenv("AT_DEVICE", "cuda")  # a device this machine lacks
    with pytest.raises(ValueError, match="^AT_DEVICE=cuda: no cuda here"):
        tools.checked_device("auto")
    status = tools.main(["translate", "Hallo."])  # --device's default
    err = capsys.readouterr().err
    assert status == 2 and "AT_DEVICE=cuda: no cuda here" in err
    assert len(err.splitlines()) == 1


@with_machine("one A100")
def test_parts_4_and_5_train_the_stand_in_where_at_device_says_cpu(
    machine, monkeypatch
):
    """With a GPU but AT_DEVICE=cpu, `quick` would have trained on the
    CPU, for a quarter of an hour or more, instead of the stand-in."""
    stand_in = tools.get_config("ci")
    chosen = tools.model_to_train_here(["cpu", "quick"], stand_in)
    assert chosen.preset == "quick"
    monkeypatch.setenv("AT_DEVICE", "cpu")
    chosen = tools.model_to_train_here(["cpu", "quick"], stand_in)
    assert chosen is stand_in


# --------------------------------------------------------- the precision
BF16, FP16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    "machine, device, precision, dtype, scaler",
    [
        ("no GPU", "cpu", "auto", None, False),  # bf16 would be emulated
        ("no GPU, AMX CPU", "cpu", "auto", BF16, False),
        ("no GPU, AMX CPU", "cpu", "bf16", BF16, False),  # the older name
        ("no GPU, AMX CPU", "cpu", "fp32", None, False),
        ("one T4", "cuda", "auto", FP16, True),  # 7.5: fp16 + GradScaler
        ("one T4", "cuda", "fp32", None, False),
        ("one P100", "cuda", "auto", FP16, True),  # fast float16
        ("one GTX 1080", "cuda", "auto", None, False),  # slow float16
        ("one A100", "cuda", "auto", BF16, False),  # 8.0: native bf16
        ("one A100", "cuda:0", "fp32", None, False),
        ("a Mac", "mps", "auto", None, False),  # float32 on MPS
    ],
    indirect=["machine"],
)
def test_precision_table(machine, device, precision, dtype, scaler):
    assert tools.choose_precision(device, precision) == (dtype, scaler)


@with_machine("one T4")
def test_at_precision_fp32_is_every_config_s_default(machine, monkeypatch):
    """The way out when float16 gives nan: the models that Parts 4 and 5
    train had no precision to change. A precision asked for still wins."""
    assert tools.get_config("quick").precision == "auto"
    monkeypatch.setenv("AT_PRECISION", "fp32")
    config = tools.get_config("quick")
    assert config.precision == "fp32"
    assert tools.choose_precision("cuda", config.precision) == (None, False)
    assert tools.get_config("quick", precision="auto").precision == "auto"
    assert tools.choose_precision("cuda") == (FP16, True)  # a pure choice
    monkeypatch.setenv("AT_PRECISION", "fp16")
    with pytest.raises(ValueError, match="^AT_PRECISION='fp16': only fp32"):
        tools.get_config("quick")


@pytest.mark.parametrize("precision", ["fp16", "bfloat16", "AUTO", ""])
def test_an_unknown_precision_is_refused(precision):
    """ "fp16" was read as "bf16": an A100 would have trained in bf16."""
    with pytest.raises(ValueError, match='"auto".*"fp32", not'):
        tools.choose_precision("cpu", precision)


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("model name\t: X\nflags\t\t: fpu avx2 avx512f\n")
    assert tools.cpu_has_native_bf16(info) is False
    info.write_text("flags\t\t: fpu avx512f avx512_bf16\n")
    assert tools.cpu_has_native_bf16(info) is True
    info.write_text("flags\t\t: fpu amx_tile amx_bf16\n")
    assert tools.cpu_has_native_bf16(info) is True
    assert tools.cpu_has_native_bf16(tmp_path / "absent") is False


def test_autocast_for_enters_the_chosen_dtype_or_nothing():
    with tools.autocast_for("cpu", torch.bfloat16)():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    with tools.autocast_for("cpu", None)():
        assert not torch.is_autocast_enabled("cpu")


# ---------------------------------------------------- ranks and devices
@pytest.mark.parametrize(
    "machine, world, fallback, devices",
    [
        ("no GPU", 1, False, ["cpu"]),
        ("no GPU", 2, False, ["cpu", "cpu"]),
        ("one T4", 1, False, ["cuda:0"]),
        ("one T4", 2, True, ["cpu", "cpu"]),  # stated fallback
        ("two A100s", 2, False, ["cuda:0", "cuda:1"]),
        ("a Mac", 1, False, ["mps"]),
        ("a Mac", 2, False, ["cpu", "cpu"]),  # gloo cannot send MPS
    ],
    indirect=["machine"],
)
def test_rank_to_device_map(machine, world, fallback, devices):
    got = [tools.process_device(r, world, fallback) for r in range(world)]
    assert got == [torch.device(d) for d in devices]
    backends = {tools.backend_for(d) for d in got}
    assert backends == {"nccl" if got[0].type == "cuda" else "gloo"}


@with_machine("one T4")
def test_more_processes_than_gpus_is_a_value_error(machine):
    with pytest.raises(ValueError, match="need a GPU each.*has 1") as err:
        tools.process_device(0, 2)
    # the way to the CPU, since --device is for one-process runs
    assert str(err.value).endswith(
        "use at most 1 process, or train them on the CPU (AT_DEVICE=cpu)"
    )


class Workers:
    """What mp.spawn(..., join=False) returns: `join` is True once every
    worker has ended, and raises what a failed worker raised."""

    processes = []  # none to stop

    def __init__(self, error=None):
        self.error = error

    def join(self):
        if self.error is not None:
            raise self.error
        return True


@with_machine("one T4")
def test_two_processes_on_one_gpu_never_reach_nccl(machine, monkeypatch):
    """fbfada1 spawned two NCCL ranks on cuda:0, which NCCL refuses."""
    spawned = []

    def spawn(fn, args, nprocs, join=True):
        spawned.append((args, nprocs))
        return Workers()

    monkeypatch.setattr(torch.multiprocessing, "spawn", spawn)
    vocab = tat.Vocab(tat.SPECIALS)
    config = tools.get_config("ci")
    with pytest.raises(ValueError):
        tools.train_distributed_model(vocab, vocab, None, None, config, 2)
    assert spawned == []
    tools.train_distributed_model(
        vocab, vocab, None, None, config, 2, cpu_fallback=True
    )
    ((args, nprocs),) = spawned
    assert nprocs == 2 and args[-2] == "cpu"  # device for every rank


def test_a_workers_user_error_is_one_line_and_a_fault_its_traceback(
    monkeypatch,
):
    """What mp.spawn raises when a worker fails: its traceback as text."""
    message = "the train split has no pair of at most 128 tokens"
    worker_says = {
        "user": "Traceback ...\nthe_annotated_transformer.DatasetError: "
        + message,
        "fault": "Traceback ...\nRuntimeError: a bug",
    }

    def failing_spawn(kind):
        def spawn(fn, args, nprocs, join=True):
            return Workers(
                torch.multiprocessing.ProcessRaisedException(
                    worker_says[kind], 0, 123
                )
            )

        return spawn

    vocab = tat.Vocab(tat.SPECIALS)
    config = tools.get_config("ci")
    monkeypatch.setattr(torch.multiprocessing, "spawn", failing_spawn("user"))
    with pytest.raises(tools.UserError) as raised:
        tools.train_distributed_model(
            vocab, vocab, None, None, config, 2, cpu_fallback=True
        )
    assert str(raised.value) == f"a training process stopped: {message}"
    monkeypatch.setattr(torch.multiprocessing, "spawn", failing_spawn("fault"))
    with pytest.raises(torch.multiprocessing.ProcessRaisedException):
        tools.train_distributed_model(
            vocab, vocab, None, None, config, 2, cpu_fallback=True
        )


def test_a_training_process_warns_in_one_line_when_main_does(
    monkeypatch, capsys
):
    """A spawned process starts with Python's two-line warnings; it gets
    the command line's one-line form when main has set it."""

    def warn_in_worker(*args, **kwargs):
        warnings.warn("a warning\nover two lines", UserWarning, stacklevel=1)

    def python_default(message, category, filename, lineno, *rest):
        """What a fresh process prints: Python's two-line form."""
        text = warnings.formatwarning(message, category, filename, lineno)
        sys.stderr.write(text)

    def spawn_here(fn, args, nprocs, join=True):  # rank 0, here
        with warnings.catch_warnings():  # as a fresh process would start
            warnings.simplefilter("always")
            warnings.showwarning = python_default
            fn(0, *args)
        return Workers()

    monkeypatch.setattr(tools, "train_worker", warn_in_worker)
    monkeypatch.setattr(torch.multiprocessing, "spawn", spawn_here)
    vocab = tat.Vocab(tat.SPECIALS)
    config = tools.get_config("ci")
    train = tools.train_distributed_model
    with warnings.catch_warnings():
        warnings.showwarning = tools.warning_line  # what main sets
        train(vocab, vocab, None, None, config, 2, cpu_fallback=True)
    err = capsys.readouterr().err
    assert err == "warning: a warning over two lines\n", err
    train(vocab, vocab, None, None, config, 2, cpu_fallback=True)
    err = capsys.readouterr().err
    assert "UserWarning" in err and len(err.splitlines()) > 1, err


def test_a_stopped_run_stops_only_the_processes_it_started(monkeypatch):
    """Ctrl-C stopped every child of the parent (active_children), so a
    notebook's own processes died with the training workers."""
    context = multiprocessing.get_context("spawn")
    own = context.Process(target=time.sleep, args=(60,))
    own.start()
    workers = []

    def spawn(fn, args, nprocs, join=True):
        worker = context.Process(target=time.sleep, args=(60,))
        worker.start()
        workers.append(worker)
        raise KeyboardInterrupt  # Ctrl-C as the workers start

    monkeypatch.setattr(torch.multiprocessing, "spawn", spawn)
    vocab = tat.Vocab(tat.SPECIALS)
    config = tools.get_config("ci")
    try:
        with pytest.raises(KeyboardInterrupt):
            tools.train_distributed_model(
                vocab, vocab, None, None, config, 2, cpu_fallback=True
            )
        (worker,) = workers
        assert not worker.is_alive()  # stopped (and joined)
        assert own.is_alive()  # not the run's to stop
    finally:
        tools.stop_processes([own, *workers])


@with_machine("one T4")
def test_train_world_size_2_on_one_gpu_is_one_line(machine, capsys):
    status = tools.main(["train", "--preset", "ci", "--world-size", "2"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert "--world-size 2" in err and "has 1" in err


def train_from_the_command_line(argv, tmp_path, monkeypatch):
    """main(["train", *argv]) with the data faked; what train_worker got."""
    got = []
    monkeypatch.setattr(tools, "download_multi30k", lambda: tmp_path)
    monkeypatch.setattr(tools, "load_tokenizers", lambda: (None, None))
    vocab = tat.Vocab(tat.SPECIALS)
    monkeypatch.setattr(tools, "load_vocabularies", lambda *a: (vocab, vocab))
    monkeypatch.setattr(
        tools, "train_worker", lambda *a, **kw: got.append((a, kw))
    )
    folder = ["--checkpoint-dir", str(tmp_path)]
    status = tools.main(["train", "--preset", "ci", *folder, *argv])
    return status, got


@with_machine("a Mac")
def test_train_device_overrides_the_picked_device(
    machine, tmp_path, monkeypatch, capsys
):
    """A Mac whose MPS fails can train on its CPU: --device cpu."""
    argv = ["--device", "cpu", "--dropout", "0.2", "--schedule", "linear"]
    argv += ["--weight-decay", "0.1"]
    status, got = train_from_the_command_line(argv, tmp_path, monkeypatch)
    ((args, kwargs),) = got
    config = args[6]  # rank, world, two vocabularies, two tokenizers, config
    assert status == 0 and kwargs["device"] == "cpu"
    assert config.dropout == 0.2 and config.preset == "ci"
    assert config.schedule == "linear"  # ci's own is noam
    assert (
        config.weight_decay == 0.1 and tools.get_config("ci").weight_decay == 0
    )
    assert tools.get_config("ci").schedule == "noam"
    assert not config.tie_embeddings and config.seed == 0  # the preset's
    status, got = train_from_the_command_line([], tmp_path, monkeypatch)
    assert status == 0 and got[0][1]["device"] is None  # pick_device's
    assert got[0][0][6].schedule == "noam"
    argv = ["--tie-embeddings", "--seed", "7"]
    status, got = train_from_the_command_line(argv, tmp_path, monkeypatch)
    assert status == 0 and got[0][0][6].tie_embeddings is True
    assert got[0][0][6].seed == 7


@with_machine("two A100s")
def test_train_device_is_for_one_process_only(
    machine, tmp_path, monkeypatch, capsys
):
    argv = ["--device", "cuda:1", "--world-size", "2"]
    status, got = train_from_the_command_line(argv, tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert status == 2 and got == [] and err.count("\n") == 1
    assert "--device" in err and "one-process" in err


# ------------------------------------------------------- a training run
SIZES = (20, 20)


@pytest.mark.parametrize(
    "machine, device, backend, dtype, scaler",
    [
        ("no GPU", "cpu", None, None, False),
        ("no GPU, AMX CPU", "cpu", None, BF16, False),
        ("one T4", "cuda", None, FP16, True),
        ("one A100", "cuda", None, BF16, False),
        ("a Mac", "mps", None, None, False),
    ],
    indirect=["machine"],
)
def test_one_process_run(machine, cpu_model, device, backend, dtype, scaler):
    config = tools.get_config("ci", precision="auto")
    run = tools.TrainingRun(0, 1, SIZES, config, False)
    assert run.device.type == device and cpu_model == [run.device]
    assert machine.groups == [] and run.model is run.module
    assert run.precision == (dtype, scaler)
    assert isinstance(run.scaler, torch.amp.GradScaler) == scaler
    # the bf16 residual stream: training in bf16 on the CPU only
    embeds = run.module.src_embed, run.module.tgt_embed
    hooked = [
        tools._stream_to_autocast_dtype in embed._forward_hooks.values()
        for embed in embeds
    ]
    wanted = device == "cpu" and dtype == BF16
    assert hooked == [wanted, wanted]
    if device == "cuda":
        assert machine.set_device == [run.device]


@pytest.mark.parametrize(
    "machine, kernel",
    [
        ("no GPU", True),
        ("no GPU, AMX CPU", True),
        ("one T4", False),
        ("one A100", False),
        ("a Mac", False),
    ],
    indirect=["machine"],
)
def test_the_cpu_kernels_only_on_the_cpu(
    machine, cpu_model, kernel, monkeypatch
):
    """Training with dropout takes the C++ dropout kernel on the CPU, in
    float32 and bf16 alike, and the loss and LayerNorm their C++ kernels;
    GPUs keep FastDropout (F.dropout there), SimpleLossCompute and Part
    1's LayerNorm. The builds are
    stubbed: only the decisions are tested here."""
    built = []
    monkeypatch.setattr(tools, "dropout_kernel", lambda: built.append(1) or 1)
    monkeypatch.setattr(tools, "loss_kernel", lambda: built.append(2) or 2)
    monkeypatch.setattr(
        tools, "layer_norm_kernel", lambda: built.append(3) or 3
    )
    config = tools.get_config("ci", precision="auto", dropout=0.1)
    run = tools.TrainingRun(0, 1, SIZES, config, False)
    kinds = {
        type(m)
        for m in run.module.modules()
        if isinstance(m, torch.nn.Dropout)
    }
    assert kinds == {tools.KernelDropout if kernel else tools.FastDropout}
    norms = {
        type(m) for m in run.module.modules() if isinstance(m, tat.LayerNorm)
    }
    assert norms == {tools.KernelLayerNorm if kernel else tat.LayerNorm}
    assert built == ([1, 3, 2] if kernel else [])
    # the loss: FusedLossCompute with the loss kernel on the CPU only
    loss_compute = tools.run_loss_compute(run)
    assert isinstance(loss_compute, tools.FusedLossCompute) == kernel
    assert getattr(loss_compute, "kernel", None) == (2 if kernel else None)


def test_the_lessons_loop_refuses_an_unknown_schedule(vocabs, tokenizers):
    config = tools.get_config("ci", schedule="cosine", max_train_pairs=40)
    with pytest.raises(ValueError, match="unknown schedule 'cosine'"):
        tat.train_one_process(*vocabs, *tokenizers, config, "cpu")


@with_machine("one A100")
def test_a_plain_cuda_device_becomes_the_current_gpu(machine, cpu_model):
    """time_to_bleu --device cuda: set_device needs the GPU's number (an
    H100 showed it: "Expected a torch.device with a specified index")."""
    config = tools.get_config("ci", precision="auto")
    run = tools.TrainingRun(0, 1, SIZES, config, False, None, "cuda")
    assert run.device == torch.device("cuda", 0) == machine.set_device[0]
    assert cpu_model == [run.device]


def as_torchrun_rank(rank, monkeypatch):
    """This process as rank `rank` of 4 under torchrun, 2 to a machine (its
    GPU is LOCAL_RANK 1), with Multi30k's download and vocabularies stubbed."""
    env = {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    env["LOCAL_WORLD_SIZE"] = "2"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tools, "download_multi30k", lambda: None)
    monkeypatch.setattr(tools, "load_tokenizers", lambda: (None, None))
    monkeypatch.setattr(tools, "load_vocabularies", lambda c, *t: (1, 2))


@with_machine("two A100s")
def test_two_a100s_under_torchrun(machine, cpu_model, monkeypatch):
    """Rank 3 of 4 on the second machine: its GPU is LOCAL_RANK 1."""
    as_torchrun_rank(3, monkeypatch)
    monkeypatch.setattr(tat, "load_tokenizers", lambda: (None, None))
    calls = []
    monkeypatch.setattr(
        tools, "train_worker", lambda *a, **k: calls.append((a, k))
    )
    assert tools.main(["train", "--preset", "ci"]) == 0
    ((args, kwargs),) = calls
    assert args[:2] == (3, 4) and kwargs["is_distributed"] is True  # DDP
    assert kwargs["device"] == torch.device("cuda", 1)
    # What that process then sets up:
    config = tools.get_config("ci", precision="auto")
    run = tools.TrainingRun(3, 4, SIZES, config, True, None, kwargs["device"])
    assert machine.set_device == [torch.device("cuda", 1)]
    group = {"backend": "nccl", "url": None, "rank": 3, "world_size": 4}
    assert machine.groups == [group]  # url None: env:// from torchrun
    assert machine.ddp_ids == [[1]]
    assert run.precision == (BF16, False)


@with_machine("two A100s")
def test_device_option_under_torchrun_with_one_process(
    machine, monkeypatch, tmp_path, capsys
):
    """--device was refused under any torchrun, as if several processes
    ran, while --threads was refused only with several; with one process
    it now chooses the device, and with two it is refused."""
    as_torchrun_rank(0, monkeypatch)
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    calls = []
    monkeypatch.setattr(
        tools, "train_worker", lambda *a, **k: calls.append((a, k))
    )
    folder = ["--checkpoint-dir", str(tmp_path / "ck")]
    argv = ["train", "--preset", "ci", "--device", "cpu", *folder]
    assert tools.main(argv) == 0, capsys.readouterr().err
    ((args, kwargs),) = calls
    assert args[:2] == (0, 1) and kwargs["is_distributed"] is False
    assert torch.device(kwargs["device"]) == torch.device("cpu")
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "2")
    assert tools.main(argv) == 2
    assert "--device chooses the device of a one-process run" in (
        capsys.readouterr().err
    )
    assert len(calls) == 1


@pytest.mark.parametrize("rank, said", [("0", True), ("3", False)])
@with_machine("two A100s")
def test_under_torchrun_only_rank_0_says_what_it_resumes(
    machine, rank, said, tmp_path, monkeypatch
):
    """Every rank checks the resume (a refusal must stop each); the notes
    were printed once per rank."""
    as_torchrun_rank(rank, monkeypatch)
    calls = []
    monkeypatch.setattr(tools, "train_worker", lambda *a, **k: None)
    monkeypatch.setattr(
        tools, "check_resume_and_say", lambda *a: calls.append("say")
    )
    monkeypatch.setattr(
        tools, "check_resume", lambda *a: calls.append("check")
    )
    folder = ["--checkpoint-dir", str(tmp_path / "ck")]
    assert tools.main(["train", "--preset", "ci", "--resume", *folder]) == 0
    assert calls == (["say"] if said else ["check"])


@pytest.mark.parametrize(
    "machine, world, local_world, expected",
    [
        ("a Mac", 2, 1, "cpu"),  # two Macs, one process each: gloo
        ("a Mac", 1, 1, "mps"),  # torchrun with one process: the GPU
        ("no GPU", 2, 1, "cpu"),
        ("two A100s", 4, 2, "cuda:1"),
    ],
    indirect=["machine"],
)
def test_torchrun_device(machine, world, local_world, expected):
    """One process per Mac got MPS, which gloo cannot send."""
    local_rank = local_world - 1
    got = tools.torchrun_device(world, local_rank, local_world)
    assert got == torch.device(expected)


@pytest.mark.parametrize(
    "cores, world, local, threads",
    [
        ({0, 1, 2, 3}, 2, None, 2),
        ({5}, 2, None, 1),
        ({0, 1, 2, 3}, 2, "1", 4),  # torchrun: one process on each machine
    ],
)
def test_processes_share_the_cores_they_may_use(
    cores, world, local, threads, monkeypatch
):
    """os.cpu_count() (16 here) counts cores a container may not use;
    only this machine's processes share them."""
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    monkeypatch.setattr(tools.os, "sched_getaffinity", lambda pid: cores)
    monkeypatch.setattr(tools.os, "cpu_count", lambda: 16)
    asked = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    assert tools.usable_cores() == len(cores)
    device = tools.place_process(0, world, False, device="cpu")
    assert device == torch.device("cpu") and asked == [threads]


def test_without_sched_getaffinity_every_core_is_usable(monkeypatch):
    """macOS and Windows have no os.sched_getaffinity."""
    monkeypatch.delattr(tools.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(tools.os, "cpu_count", lambda: 10)
    assert tools.usable_cores() == 10
    monkeypatch.setattr(tools.os, "cpu_count", lambda: None)
    assert tools.usable_cores() == 1


@pytest.mark.parametrize(
    "device, rank, expected",
    [("cuda", 1, "cuda:1"), ("cuda", 0, "cuda:0"), ("cpu", 1, "cpu")],
)
def test_a_spawned_process_takes_the_gpu_of_its_rank(
    device, rank, expected, monkeypatch
):
    """mp.spawn's processes start afresh, so this runs the spawned
    function in this process, with train_worker recording its device."""
    got = {}

    def worker(rank, world_size, *args, device=None, **kwargs):
        got.update(rank=rank, device=device)

    monkeypatch.setattr(tools, "train_worker", worker)
    specials = list(tat.SPECIALS)
    config = vars(tools.get_config("ci"))
    tools._spawned_worker(
        rank, 2, [specials] * 2, [None] * 2, config, 29500, False, device
    )
    assert got == {"rank": rank, "device": expected}


@pytest.mark.parametrize(
    "machine, keys",
    [("no GPU", set()), ("one T4", {"gpus"}), ("a Mac", {"mps"})],
    indirect=["machine"],
)
def test_the_hardware_summary_names_the_accelerator(machine, keys):
    """A results file says where it trained: the GPUs, or a Mac's MPS."""
    summary = tools.hardware_summary()
    assert {"cpu", "cpu_threads", "torch"} <= summary.keys()
    assert summary.keys() & {"gpus", "mps"} == keys


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "machine, device, pinned",
    [
        ("no GPU", "cpu", False),
        ("one T4", "cuda:0", True),
        ("a Mac", "cpu", False),  # as train_distributed_model passes
    ],
    indirect=["machine"],
)
def test_worker_pins_memory_on_cuda_and_always_leaves_the_group(
    machine, device, pinned, cpu_model, monkeypatch
):
    """fbfada1 never pinned memory, and left the group only on success."""
    asked = {}

    def shard(loader, world_size, rank, pin_memory=False):
        asked.update(pin_memory=pin_memory)
        return [None] * 4  # four batches for this rank

    def fail(*args, **kwargs):
        raise RuntimeError("stop here")

    monkeypatch.setattr(tools, "create_dataloaders", lambda *a, **k: [0, 1])
    monkeypatch.setattr(tools, "shard_loader", shard)
    monkeypatch.setattr(tools, "train_epoch", fail)
    vocab = tat.Vocab(tat.SPECIALS)
    config = tools.get_config("ci")
    with pytest.raises(RuntimeError, match="stop here"):
        tools.train_worker(
            0, 2, vocab, vocab, None, None, config, True, device=device
        )
    assert asked["pin_memory"] is pinned
    assert len(machine.groups) == 1 and machine.destroyed == 1


@with_machine("a Mac")
def test_a_process_group_on_mps_is_refused_before_joining(machine):
    """gloo cannot send MPS tensors; train_worker(device="mps") with
    several processes joined a group and wrapped an MPS model in DDP."""
    vocab = tat.Vocab(tat.SPECIALS)
    config = tools.get_config("ci")
    with pytest.raises(ValueError, match="device='cpu'"):
        tools.train_worker(
            0, 2, vocab, vocab, None, None, config, True, device="mps"
        )
    assert machine.groups == []
    assert tools.place_process(0, 1, False, "mps") == torch.device("mps")


# --------------------------------------------- notebook 03's training cell
@pytest.mark.parametrize(
    "machine, device, dtype",
    [
        ("no GPU", "cpu", None),
        ("one T4", "cuda", FP16),  # fbfada1: the untrained paper preset
        ("one A100", "cuda", BF16),  # fbfada1: the untrained paper preset
        ("a Mac", "mps", None),  # fbfada1: trained on the CPU
    ],
    indirect=["machine"],
)
def test_notebook_trains_quick_on_the_picked_device(
    machine, cpu_model, device, dtype
):
    """Part 3's cell: get_config("quick") and pick_device() to train_worker."""
    config = tools.get_config("quick")
    device_here = tat.pick_device()
    run = tools.TrainingRun(0, 1, SIZES, config, False, None, device_here, 153)
    assert run.device.type == device and cpu_model == [run.device]
    assert config.schedule == "linear" and run.precision.dtype == dtype
    line = tools.describe_device(run.device, run.precision)
    assert line.startswith(f"device: {device}")


# ------------------------------------------------ decoding on any device
@pytest.mark.parametrize(
    "machine, device",
    [("no GPU", "cpu"), ("one T4", "cuda"), ("a Mac", "mps")],
    indirect=["machine"],
)
def test_translate_and_the_command_line_default_to_pick_device(
    machine, device, monkeypatch
):
    """fbfada1: translate() and --device were "cpu" on every machine."""
    asked = []

    def loader(checkpoint, device, beam, average_last, alpha):
        # what load_translator does with "auto" first
        asked.append(tools.checked_device(device).type)
        raise RuntimeError("stop here")

    monkeypatch.setattr(tools, "load_translator", loader)
    with pytest.raises(RuntimeError, match="stop here"):
        tools.translate(["Ein Hund."])
    args = tools.build_parser().parse_args(["translate", "Ein Hund."])
    assert asked == [device] and torch.device(args.device).type == device


def test_averaging_sums_on_the_cpu_then_moves(tmp_path, monkeypatch):
    """MPS has no float64: every file is read onto the CPU and summed there;
    only the result moves (here to `meta`, which needs no hardware)."""
    sizes = (len(tat.SPECIALS) + 3, len(tat.SPECIALS) + 4)
    vocabs = [tat.Vocab([*tat.SPECIALS, *"abcd"[: n - 4]]) for n in sizes]
    config = tools.get_config("ci", checkpoint_dir=str(tmp_path))
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        run = tools.TrainingRun(0, 1, sizes, config, False, device="cpu")
        tools.save_run(run, f"epoch_{seed:03d}.pt", *vocabs)
        paths.append(tmp_path / f"epoch_{seed:03d}.pt")
    read = []
    load = tools.load_checkpoint

    def recording(path, device="cpu"):
        read.append(str(device))
        return load(path, device)

    monkeypatch.setattr(tools, "load_checkpoint", recording)
    model, *_ = tools.average_checkpoints(paths, device="meta")
    assert read and set(read) == {"cpu"}
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_load_trained_model_follows_pick_device(tmp_path, monkeypatch):
    """fbfada1 loaded onto the CPU unless told otherwise: a Mac or a GPU
    machine got the CPU silently. Here pick_device answers `meta`."""
    sizes = (len(tat.SPECIALS) + 3, len(tat.SPECIALS) + 4)
    vocabs = [tat.Vocab([*tat.SPECIALS, *"abcd"[: n - 4]]) for n in sizes]
    config = tools.get_config("ci", checkpoint_dir=str(tmp_path))
    run = tools.TrainingRun(0, 1, sizes, config, False, device="cpu")
    tools.save_run(run, "final.pt", *vocabs)
    monkeypatch.setattr(tools, "pick_device", lambda: torch.device("meta"))
    model, *_ = tools.load_trained_model(tmp_path / "final.pt")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    model, *_ = tools.load_trained_model(tmp_path / "final.pt", "cpu")
    assert {p.device.type for p in model.parameters()} == {"cpu"}


# ------------------------------------------ no host sync in the loop
def tiny_copy_run(nbatches):
    """A tiny copy-task model, `nbatches` batches of 4, and its loss."""
    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    gen = torch.Generator().manual_seed(0)
    batches = list(tat.data_gen(11, 4, nbatches, generator=gen))
    crit = tat.LabelSmoothing(11, 0, smoothing=0.1)
    return model, batches, tat.SimpleLossCompute(model.generator, crit)


def test_run_epoch_reads_the_loss_once(monkeypatch):
    """fbfada1 called .item() on every micro-batch (SimpleLossCompute)."""
    model, batches, loss_compute = tiny_copy_run(6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reads = []
    for name in ("item", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counting(self, _original=original, _name=name):
            reads.append(_name)
            return _original(self)

        monkeypatch.setattr(torch.Tensor, name, counting)
    loss, _ = tat.run_epoch(batches, model, loss_compute, opt, accum_iter=2)
    monkeypatch.undo()
    assert reads == ["__float__"]  # the epoch's total, once
    assert isinstance(loss, float) and loss > 0


def test_a_skipped_float16_step_leaves_the_weights_and_warns_nothing():
    """A step that the GradScaler skips would make PyTorch warn that the
    schedule stepped before the optimizer, were Adam not fused: the scaler
    then always calls its step, with the overflow flag. make_optimizer
    fuses Adam on the CPU and on CUDA, where float16 trains; the CPU's
    fused Adam and GradScaler stand in for the GPU's."""
    model = torch.nn.Linear(3, 1)
    optimizer, scheduler = tat.make_optimizer(model, 16)
    assert optimizer.param_groups[0]["fused"]
    scaler = torch.amp.GradScaler("cpu")
    overflowing = (model(torch.ones(1, 3)) * float("inf")).sum()
    scaler.scale(overflowing).backward()
    before = model.weight.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tat.optimizer_step(
            optimizer, scheduler, list(model.parameters()), scaler=scaler
        )
    assert caught == []
    assert torch.equal(model.weight.detach(), before)  # skipped
    assert scaler.get_scale() == 2.0**15  # and the scale halved


def test_a_float16_run_steps_through_its_grad_scaler():
    """A T4's path: float16 autocast with a GradScaler. A step whose
    gradients overflowed is skipped and the scale halves; the others step.
    The CPU's float16 autocast and GradScaler stand in for the GPU's."""
    model, batches, plain = tiny_copy_run(2)
    calls = []

    def overflow_second(out, y, norm):
        loss_sum, loss_mean = plain(out, y, norm)
        calls.append(len(calls))
        if len(calls) == 2:  # the second batch's gradients are inf
            return loss_sum, loss_mean * float("inf")
        return loss_sum, loss_mean

    opt, _ = tat.make_optimizer(model, 16, warmup=5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    fp16 = lambda: torch.autocast("cpu", dtype=torch.float16)
    flat = lambda: torch.cat(
        [p.detach().flatten() for p in model.parameters()]
    )
    weights = [flat()]

    def one_batch(batch):
        tat.run_epoch(
            [batch], model, overflow_second, opt, scaler=scaler, autocast=fp16
        )
        weights.append(flat())

    one_batch(batches[0])
    assert not torch.equal(weights[1], weights[0])  # stepped
    assert scaler.get_scale() == 2.0**16
    one_batch(batches[1])
    assert torch.equal(weights[2], weights[1])  # skipped: inf gradients
    assert scaler.get_scale() == 2.0**15  # halved
    assert torch.isfinite(weights[2]).all()


def test_device_batch_equals_batch():
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(4, 30, (5, 9), generator=gen)
    tgt = torch.randint(4, 30, (5, 11), generator=gen)
    src[0, 6:], tgt[1, 4:] = tat.PAD, tat.PAD
    made, reference = tools.device_batch(src, tgt, "cpu"), tat.Batch(src, tgt)
    assert made.ntokens == reference.ntokens == int((tgt[:, 1:] != 2).sum())
    for name in ("src", "src_mask", "tgt", "tgt_y", "tgt_mask"):
        assert torch.equal(getattr(made, name), getattr(reference, name))


@pytest.mark.parametrize(
    "device, asynchronous",
    [("cuda", True), ("cuda:1", True), ("mps", False), ("cpu", False)],
)
def test_batches_copy_asynchronously_only_to_a_cuda_gpu(
    device, asynchronous, monkeypatch
):
    """To MPS, such a copy can read its source after it is freed and
    silently give other token ids (PyTorch issues 139550 and 189690)."""
    copies = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (str, torch.device)):
            if torch.device(target) == torch.device(device):
                copies.append(kwargs.get("non_blocking", False))
            return self  # no GPU here: only the call is recorded
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    src = torch.randint(4, 30, (3, 7))
    tgt = torch.randint(4, 30, (3, 9))
    tat.Batch(src, tgt).to(device)
    tools.device_batch(src, tgt, device)
    monkeypatch.undo()
    assert len(copies) >= 7  # five tensors of the Batch, two of device_batch
    assert copies == [asynchronous] * len(copies)


def recorded_copies(monkeypatch):
    """Record every Tensor.to that names a device, and still copy."""
    copies = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, (str, torch.device)):
            copies.append((torch.device(target), tuple(self.shape)))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return copies


def test_a_batchs_masks_are_made_on_its_device_not_copied(monkeypatch):
    """On a GPU a copy from the CPU that is not asynchronous waits for the
    GPU's queued work: the masks of every batch must be made where the
    batch is. The meta device stands in for the GPU."""
    src = torch.randint(4, 30, (3, 7))
    tgt = torch.randint(4, 30, (3, 9))
    copies = recorded_copies(monkeypatch)
    batch = tools.device_batch(src, tgt, "meta")
    monkeypatch.undo()
    meta = torch.device("meta")
    assert copies == [(meta, (3, 7)), (meta, (3, 9))]  # src and tgt only
    assert batch.src_mask.device == batch.tgt_mask.device == meta
    assert tat.subsequent_mask(4, meta).device == meta


def test_decoding_makes_no_copies_per_step(monkeypatch):
    """Each greedy step's causal mask is made on the source's device."""
    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2).eval()
    src = torch.randint(3, 11, (2, 6))
    src_mask = (src != tat.PAD).unsqueeze(-2)
    copies = recorded_copies(monkeypatch)
    with torch.no_grad():
        tat.greedy_decode(model, src[:1], src_mask[:1], 8, tat.BOS)
        tat.batch_greedy_decode(model, src, src_mask, 8)
    monkeypatch.undo()
    assert copies == []


def test_every_decoder_makes_its_tensors_on_the_sources_device():
    """With the meta device as the default, a tensor that a decoder makes
    without `device=` lands on meta, and the first step that mixes it
    with the model's CPU tensors fails. Beam search made its token table
    on the CPU and copied it to the GPU at every call."""
    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2).eval()
    src = torch.randint(3, 11, (2, 6))
    src_mask = (src != tat.PAD).unsqueeze(-2)
    decoders = {
        "greedy": lambda: tat.greedy_decode(
            model, src[:1], src_mask[:1], 8, tat.BOS
        ),
        "batched": lambda: tat.batch_greedy_decode(model, src, src_mask, 8),
        "cached": lambda: tat.cached_greedy_decode(model, src, src_mask, 8),
        "beam": lambda: tat.beam_search(model, src, src_mask, 8, beam_size=3),
    }
    for name, decode in decoders.items():
        with torch.no_grad(), torch.device("meta"):
            out = decode()
        assert out.device == src.device, name


def test_a_models_weights_are_all_float32():
    """MPS has no float64: every floating tensor a model holds (weights
    and buffers such as the positional encodings) must be float32."""
    config = tools.get_config("quick")
    with torch.device("meta"):  # shapes and dtypes only
        model = tools.model_from_config(config, 100, 120)
    dtypes = {t.dtype for t in model.state_dict().values()}
    assert dtypes == {torch.float32}


@with_machine("a Mac")
def test_mps_is_a_device_on_a_mac(machine):
    assert tools.existing_device("mps") == "mps"
    assert tools.existing_device("auto") == "mps"


@with_machine("no GPU")
def test_mps_is_refused_elsewhere(machine):
    with pytest.raises(argparse.ArgumentTypeError, match="no mps"):
        tools.existing_device("mps")


@pytest.mark.parametrize(
    "machine, name, expected",
    [
        ("no GPU", "auto", "cpu"),
        ("no GPU", None, "cpu"),
        ("no GPU", "cpu:0", "cpu:0"),
        ("one T4", "auto", "cuda"),
        ("one T4", "cuda:0", "cuda:0"),
        ("two A100s", "cuda:1", "cuda:1"),
        ("a Mac", "auto", "mps"),
    ],
    indirect=["machine"],
)
def test_checked_device_keeps_what_the_machine_has(machine, name, expected):
    assert tools.checked_device(name) == torch.device(expected)


@pytest.mark.parametrize(
    "machine, name, message",
    [
        ("no GPU", "cuda", "no cuda here: this machine has 0 CUDA devices"),
        ("one T4", "cuda:1", "no cuda:1 here: this machine has 1 CUDA device"),
        ("no GPU", "mps", "no mps here: this machine has no Apple GPU"),
        ("no GPU", "cpu:7", "no cpu:7 here: the CPU is one device, cpu"),
        ("a Mac", "mps:1", "no mps:1 here: a Mac has one Apple GPU, mps"),
        ("no GPU", "gpu", "'gpu' is not a device; try cpu, cuda or cuda:1"),
        (
            "a Mac",
            "meta",
            "no meta here: only cpu, cuda and mps are supported",
        ),
    ],
    indirect=["machine"],
)
def test_checked_device_refuses_what_the_machine_lacks(machine, name, message):
    with pytest.raises(ValueError) as err:
        tools.checked_device(name)
    assert str(err.value) == message
    with pytest.raises(argparse.ArgumentTypeError) as err:
        tools.existing_device(name)  # the command line's --device
    assert str(err.value) == message


@with_machine("no GPU")
def test_translate_refuses_a_missing_gpu_before_reading(machine, tmp_path):
    missing = tmp_path / "none.pt"  # never read: the device comes first
    with pytest.raises(ValueError, match="no cuda here"):
        tools.translate("Ein Hund.", checkpoint=missing, device="cuda")
    with pytest.raises(ValueError, match="no cuda:0 here"):
        tools.load_translator(missing, device="cuda:0")


def test_shard_loader_pins_memory_when_asked(
    local_multi30k, vocabs, tokenizers
):
    loaders = tat.create_dataloaders(*vocabs, *tokenizers, max_train_pairs=40)
    plain = [tools.shard_loader(d, 1, 0) for d in loaders]
    pinned = [tools.shard_loader(d, 1, 0, pin_memory=True) for d in loaders]
    assert [d.pin_memory for d in [*loaders, *plain]] == [False] * 4
    assert [d.pin_memory for d in pinned] == [True, True]


def test_all_reduce_loss_weights_ranks_by_tokens(monkeypatch):
    """Rank 0 saw 10 tokens at loss 2.0; the other rank 30 at 4.0."""
    other = torch.tensor([4.0 * 30, 30.0], dtype=torch.float64)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(
        torch.distributed, "all_reduce", lambda t: t.add_(other)
    )
    assert tools.all_reduce_loss(2.0, 10, "cpu") == pytest.approx(3.5)


# ------------------------------------------ real training, on this CPU
@pytest.mark.usefixtures("local_multi30k", "one_thread")
@pytest.mark.parametrize("schedule", ["noam", "linear"])
@pytest.mark.parametrize("loss", ["lesson's", "fused"])
def test_worker_and_lesson_loop_agree(
    tmp_path, vocabs, tokenizers, schedule, loss, monkeypatch
):
    """The appendix's train_worker is the lesson's loop plus files. With
    the lesson's loss (SimpleLossCompute) it ends with the same weights;
    with its own (FusedLossCompute, the same numbers rounded in another
    order) with the same losses, since Adam, at the `ci` preset's peak
    rate of 0.056, turns rounding in near-zero gradients into steps of
    up to 1e-2 (the key biases' true gradient is exactly zero)."""
    if loss == "lesson's":
        monkeypatch.setattr(tools, "FusedLossCompute", tat.SimpleLossCompute)
        # and Part 1's LayerNorm: the kernel's rounds in another order
        monkeypatch.setattr(tools, "layer_norm_kernel", lambda: None)
    config = tools.get_config(
        "ci",
        epochs=2,
        max_train_pairs=300,
        checkpoint_dir=str(tmp_path),
        schedule=schedule,
    )
    model, history = tat.train_one_process(*vocabs, *tokenizers, config, "cpu")
    worker = tools.train_worker(
        0, 1, *vocabs, *tokenizers, config, show_progress=False, device="cpu"
    )
    assert [h["steps"] for h in history] == [h["steps"] for h in worker]
    for mine, theirs in zip(history, worker, strict=True):
        for key in ("train_loss", "val_loss"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5)
    if loss == "fused":
        return
    saved = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    for name, value in model.state_dict().items():
        assert torch.allclose(value, saved[name], atol=1e-6), name


@pytest.mark.usefixtures("local_multi30k", "one_thread")
def test_ddp_validation_loss_covers_the_whole_set(
    tmp_path, vocabs, tokenizers
):
    """fbfada1 recorded rank 0's half of the validation set."""
    config = tools.get_config(
        "ci", epochs=1, max_train_pairs=400, checkpoint_dir=str(tmp_path)
    )
    tools.train_distributed_model(
        *vocabs, *tokenizers, config, world_size=2, cpu_fallback=True
    )  # two CPU processes, also on a machine with one GPU
    ckpt = torch.load(tmp_path / "final.pt", weights_only=True)
    model = tat.model_from_config(config, *map(len, vocabs), dropout=0.0)
    model.load_state_dict(ckpt["model"])
    model.eval()
    _, valid = tat.create_dataloaders(
        *vocabs,
        *tokenizers,
        max_tokens=config.max_tokens,
        max_train_pairs=config.max_train_pairs,
    )
    crit = tat.LabelSmoothing(len(vocabs[1]), tat.PAD, config.label_smoothing)
    loss_compute = tat.SimpleLossCompute(model.generator, crit)
    batches = (tat.Batch(s, t, tat.PAD) for s, t in valid)
    whole, _ = tat.run_epoch(batches, model, loss_compute, mode="eval")
    assert ckpt["history"][-1]["val_loss"] == pytest.approx(whole, rel=1e-4)


class DeviceWithoutFloat64(torch.overrides.TorchFunctionMode):
    """A default device that, like Apple's MPS, refuses float64: any
    float64 tensor that lands off the CPU raises as MPS does."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        off_cpu = isinstance(out, torch.Tensor) and out.device.type != "cpu"
        if off_cpu and out.dtype == torch.float64:
            raise TypeError("Cannot convert a MPS Tensor to float64 dtype")
        return out


def test_positional_table_is_built_where_float64_exists():
    """Under torch.set_default_device("mps") the float64 table was made on
    the GPU, which has no float64. "meta" stands in for that device; the
    table must still come out on it, in float32."""
    reference = tat.PositionalEncoding(16, dropout=0.0).pe
    with torch.device("meta"), DeviceWithoutFloat64():
        pe = tat.PositionalEncoding(16, dropout=0.0).pe
        model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    assert pe.device.type == "meta" and pe.dtype == torch.float32
    assert pe.shape == reference.shape and reference.device.type == "cpu"
    assert {p.device.type for p in model.parameters()} == {"meta"}
    with torch.device("meta"), DeviceWithoutFloat64():
        with pytest.raises(TypeError, match="float64"):  # it does fire
            torch.zeros(1, dtype=torch.float64)


def test_attention_statistics_stay_beside_the_weights():
    """Part 4's statistics made float64 and mask tensors on the default
    device: under torch.set_default_device("mps") they failed (float64),
    and the decoder's mask landed on another device than the weights."""
    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    src, tgt = [0, 5, 6, 7, 1], [0, 8, 9, 1]
    maps = tat.attention_maps(model, src, tgt)
    reference = tat.attention_statistics(maps)
    with torch.device("meta"), DeviceWithoutFloat64():
        views = [maps.view(kind) for kind in tat.ATTENTION_KINDS]
        stats = tat.attention_statistics(maps)
    assert {v.allowed.device.type for v in views} == {"cpu"}
    assert stats == reference and len(stats) == 3 * 2  # kinds × heads


@with_machine("no GPU")  # torch.load alone refuses only without CUDA
def test_a_checkpoint_saved_on_a_gpu_loads_on_this_cpu(
    machine, tmp_path, monkeypatch
):
    """Every load maps to the CPU: a final.pt trained on Colab's GPU must
    load on a laptop or a Mac, where torch.load alone refuses it."""
    torch.manual_seed(0)
    model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    optimizer, _ = tat.make_optimizer(model, d_model=16)
    model.generator(
        model.encode(torch.ones(1, 3).long(), None)
    ).sum().backward()
    optimizer.step()  # Adam's state now holds tensors too
    path = tmp_path / "last.pt"
    with monkeypatch.context() as gpu:  # torch.save records "cuda:0"
        gpu.setattr(torch.serialization, "location_tag", lambda s: "cuda:0")
        tools.save_checkpoint(
            path, model=model.state_dict(), optimizer=optimizer.state_dict()
        )
    with pytest.raises(RuntimeError, match="CUDA device"):
        torch.load(path, weights_only=True)  # the file really says GPU
    ckpt = tools.load_checkpoint(path)
    for name, weight in model.state_dict().items():
        assert ckpt["model"][name].device.type == "cpu"
        assert torch.equal(ckpt["model"][name], weight)
    found, resumed = tools.resume_checkpoint(tmp_path)
    states = resumed["optimizer"]["state"].values()
    assert found == path and {s["exp_avg"].device.type for s in states} == {
        "cpu"
    }


@pytest.mark.parametrize("device, fused", [("cpu", True), ("meta", False)])
def test_fused_adam_only_where_it_exists(device, fused):
    """Adam(fused=True) exists on the CPU and CUDA only; "meta" stands in
    for Apple's MPS, where asking for it failed in older torch."""
    with torch.device(device):
        model = tat.make_model(11, 11, N=1, d_model=16, d_ff=32, h=2)
    optimizer, _ = tat.make_optimizer(model, d_model=16)
    assert optimizer.defaults["fused"] is fused


def test_fused_attention_off_the_cpu_even_with_dropout():
    """Only a CPU trains with dropout outside the fused routine."""
    mha = tat.MultiHeadedAttention(2, 16, dropout=0.1).train()
    assert mha.use_fused(torch.zeros(1, 2, 3, 8, device="meta"))
    assert not mha.use_fused(torch.zeros(1, 2, 3, 8))  # CPU, dropout
    assert mha.eval().use_fused(torch.zeros(1, 2, 3, 8))


@with_machine("one T4")
def test_torchrun_two_processes_on_one_gpu_is_refused(machine):
    with pytest.raises(ValueError, match="need a GPU each.*at most 1"):
        tools.torchrun_device(2, 1, 2)
