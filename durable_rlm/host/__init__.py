"""What this machine tells about its processes and files, read without trusting them.

Standard library only, and no other module of the package: the worker's activities, the
shared server's supervisor and the page all use it, and a reaper loaded on its own does too.
"""
