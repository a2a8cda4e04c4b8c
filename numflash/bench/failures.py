"""How a failed call is classified and described in the report: out of memory (OOM), a peer that
refuses the inputs (skipped, with torch's own reasons), or an error; one short line each."""
import re


def is_oom(exc):
    """True for an out-of-memory error of NumPy, CuPy or torch."""
    if isinstance(exc, MemoryError):  # cupy.cuda.memory.OutOfMemoryError is a MemoryError
        return True
    return "OutOfMemory" in type(exc).__name__ or "out of memory" in str(exc).lower()


def first_line(text, n=160):
    text = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return text if len(text) <= n else text[:n - 3] + "..."


def clean_torch_warnings(messages, limit=300):
    """torch's reasons for refusing an SDPA backend, without its source locations and filler."""
    out = []
    for msg in messages:
        msg = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", str(msg)).strip()
        if not msg or msg.endswith("because:") or "runtime disabled" in msg:
            continue
        if msg not in out:
            out.append(msg)
    text = "; ".join(out)
    return text if len(text) <= limit else text[:limit - 3] + "..."

