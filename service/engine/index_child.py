"""One outlines-core Index, built in a process of its own (grammar.py's `_compile` runs this file
as a script, so it imports nothing of the service): stdin the pickled (regex, vocabulary, bytes
of address space the process may use); stdout the pickled Index; exit status 3 with the error's
text on stderr for a pattern that does not compile over the vocabulary."""
import pickle
import resource
import sys

DOES_NOT_COMPILE = 3


def main() -> int:
    regex, vocabulary, limit = pickle.load(sys.stdin.buffer)       # imports outlines_core
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import outlines_core
    try:
        index = outlines_core.Index(regex, vocabulary)
    except (ValueError, TypeError) as e:
        sys.stderr.write(str(e))
        return DOES_NOT_COMPILE
    sys.stdout.buffer.write(pickle.dumps(index))
    return 0


if __name__ == "__main__":
    sys.exit(main())
