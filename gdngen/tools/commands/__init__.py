"""The bodies of the ``gdngen`` commands, by role: `gdngen.tools.commands.options` (what
several share), `gdngen.tools.commands.checks` (validate, bench), `gdngen.tools.commands.builds`
(build), `gdngen.tools.commands.tuning` (tune), `gdngen.tools.commands.caches` (devices, show,
merge, report), `gdngen.tools.commands.doctor` (doctor). `gdngen.tools.cli` registers them on
its group; this package imports none of them."""
