"""The small commands of ``gpipe`` (``schedule``, ``corpus``, ``vocab``), and what every
command shares (:mod:`gpipe.commands.args`: the one-line usage error and its parser).

An application: imports the library and the other applications' modules (``gpipe.data``, ...), never
the command line's dispatcher :mod:`gpipe.cli`, which sits above every command.
"""
