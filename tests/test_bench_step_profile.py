"""bench/step_profile.py puts each py-spy sample where it belongs and counts a window's steps right.

The benchmark's figures are its categories: a sample of the side channel's send counted as the
model, or the engine core's spin counted as the worker's, would misplace milliseconds silently.
"""

from __future__ import annotations

from pathlib import Path

from bench.step_profile import Profile, Window, _in_window

SERVER = 'process 10:"python -m prismgate serve --engine vllm"'
CORE = f'{SERVER};process 11:"VLLM::EngineCore"'
WORKER = f'{CORE};process 12:"VLLM::Worker"'
RUNNER = "WorkerProc.worker_busy_loop (m.py:1041);GPUModelRunner.execute_model (gpu_model_runner.py:4207)"
W_MAIN = f"{WORKER};thread (12): MainThread"
C_MAIN = f"{CORE};thread (11): MainThread"
S_LOOP = f"{SERVER};thread (10): MainThread;BaseEventLoop._run_once (b.py:1)"


def raw(lines: list[tuple[str, int]]) -> str:
    return "".join(f"{stack} {count}\n" for stack, count in lines)


def test_samples_go_to_their_process_and_category(tmp_path: Path) -> None:
    path = tmp_path / "spy.txt"
    path.write_text(
        raw(
            [
                (f"{W_MAIN};{RUNNER};_Tap._model_forward (worker.py:130);"
                 "_Tap._after (worker.py:212);Sender.send (channel.py:161);Socket.send_multipart (socket.py:767)", 4),
                (f"{W_MAIN};{RUNNER};_Tap._model_forward (worker.py:130);"
                 "_Tap._after (worker.py:212);_Tap._collect (worker.py:220)", 2),
                (f"{W_MAIN};{RUNNER};_Tap._model_forward (worker.py:129);"
                 "GPUModelRunner._model_forward (gpu_model_runner.py:3001);Runner.call (x.py:1)", 300),
                (f"{W_MAIN};{RUNNER};Sampler.forward (sampler.py:9)", 50),
                (f"{W_MAIN};WorkerProc.worker_busy_loop (m.py:1);MessageQueue.dequeue (s.py:2)", 30),
                (f"{WORKER};thread (13): tqdm_monitor;TMonitor.run (_monitor.py:69)", 7),  # not the main thread
                (f"{C_MAIN};EngineCore.step (core.py:5);MessageQueue.acquire_read (s.py:864)", 200),
                (f"{C_MAIN};EngineCore.step (core.py:5);Scheduler.schedule (scheduler.py:9)", 3),
                (f"{CORE};thread (20): Thread-2 (process_output_sockets);EngineCoreProc.process_output_sockets", 5),
                (f"{S_LOOP};Receiver._drain (tracker.py:177)", 6),
                (f"{S_LOOP};_Writer.run (stream.py:9)", 8),
            ]
        )
    )  # fmt: skip
    profile = Profile.read(path, rate=100)
    assert profile.seconds_in("worker", "prismgate: side channel send") == 0.04
    assert profile.seconds_in("worker", "prismgate: read readouts, build packet") == 0.02
    assert profile.seconds_in("worker", "model forward") == 3.0
    assert profile.seconds_in("worker", "runner host code (inputs, sampling)") == 0.5
    assert profile.seconds_in("worker", "waiting for the next step") == 0.3
    assert profile.seconds_in("engine core", "waiting for the worker") == 2.0
    assert profile.seconds_in("engine core", "scheduling") == 0.03
    assert profile.seconds_in("engine core", "sending outputs (its thread)") == 0.05
    assert profile.seconds_in("front-end", "prismgate: side channel receive and routing") == 0.06
    assert profile.seconds_in("front-end", "API, streaming and the rest") == 0.08
    # the worker's other threads are not its step
    assert sum(n for (process, _), n in profile.samples.items() if process == "worker") == 386

    window = Window("t", streams=2, seconds=4.0, tokens=100.0, profile=profile)
    assert window.steps == 50 and window.step_ms == 80.0
    assert window.ms_per_step("worker", "model forward") == 60.0
    assert round(window.ms_in("worker"), 6) == round(1000 * 3.86 / 50, 6)


def test_tokens_in_a_window_are_each_answers_share_of_its_span() -> None:
    spans = [(0.0, 10.0, 64), (5.0, 15.0, 64), (20.0, 30.0, 64)]
    assert _in_window(spans, 5.0, 15.0) == 32 + 64  # half of the first, all of the second, none of the third
