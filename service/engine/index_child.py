"""One outlines-core Index, or one JSON schema's regex, built in a process of its own (grammar.py's
`_in_child` runs this file as a script, so it imports nothing of the service): stdin the pickled
(regex, vocabulary, bytes of address space the process may use), or (schema text, None, bytes);
stdout the pickled Index, or the regex; exit status 3 with the error's text on stderr for a
pattern that does not compile over the vocabulary, or a schema outlines-core refuses. A schema's
regex has its own process because its size can double at each level of nesting (50 nested
arrays: a regex of about 2^50 characters, built holding the GIL). The process runs at the lowest
CPU priority (NICE): a pattern that compiles for its whole time limit then takes only the cores
that serving leaves idle, where at its default priority it held one of a 2-core CPU's two and
other requests slowed to seconds."""
import os
import pickle
import resource
import sys

DOES_NOT_COMPILE = 3
NICE = 19


def main() -> int:
    os.nice(NICE - os.nice(0))
    regex, vocabulary, limit = pickle.load(sys.stdin.buffer)       # imports outlines_core
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import outlines_core
    import outlines_core.json_schema
    try:
        made = outlines_core.json_schema.build_regex_from_schema(regex) if vocabulary is None else \
            outlines_core.Index(regex, vocabulary)
    except (ValueError, TypeError) as e:
        sys.stderr.write(str(e))
        return DOES_NOT_COMPILE
    sys.stdout.buffer.write(pickle.dumps(made))
    return 0


if __name__ == "__main__":
    sys.exit(main())
