"""The rank processes seen from the controller: spawning them (group.py: in-process at world size 1,
forked from the rank template or fresh interpreters, or under torchrun), a rank process's entry point
(process.py), the template CPU ranks are forked from (template.py) and the boot progress they report
(progress.py)."""
