"""Each class's tokenizer thread."""
import threading

from services.common.priority import HIGH, LOW, MEDIUM
from services.scheduler.tokenizer_threads import TokenizerThreads


def run_in(threads: TokenizerThreads, priority: int) -> str:
    """The name of the thread that tokenizes `priority`'s prompts."""
    return threads.executor(priority).submit(lambda: threading.current_thread().name).result(timeout=10)


def test_each_class_tokenizes_on_its_own_thread():
    threads = TokenizerThreads()
    try:
        names = {priority: run_in(threads, priority) for priority in (HIGH, MEDIUM, LOW)}
        assert names[HIGH].startswith("tokenizer-high") and names[LOW].startswith("tokenizer-low")
        assert len(set(names.values())) == 3
        # A priority outside the classes tokenizes as Medium (admission refuses it afterwards).
        assert run_in(threads, 99) == names[MEDIUM]
    finally:
        threads.shutdown()


def test_only_highs_chat_length_prompts_are_tokenized_on_the_event_loop():
    from services.common.priority import HIGH, LOW, MEDIUM
    from services.scheduler.tokenizer_threads import HIGH_INLINE_CHARS
    assert TokenizerThreads.inline(HIGH, 300) and TokenizerThreads.inline(HIGH, HIGH_INLINE_CHARS)
    assert not TokenizerThreads.inline(HIGH, HIGH_INLINE_CHARS + 1)
    assert not TokenizerThreads.inline(MEDIUM, 10) and not TokenizerThreads.inline(LOW, 10)
