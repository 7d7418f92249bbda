"""The ``refengine`` subcommands other than ``serve``: each module adds its parser and runs it
(``generate``, ``bench``, ``conformance``). ``refengine.cli`` assembles them into the command;
they never import it."""
