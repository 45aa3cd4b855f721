"""A script that ends while a thread it started (not a daemon) waits forever: Python's exit waits for it."""
import sys
import threading

threading.Thread(target=threading.Event().wait, name="never-ends").start()
sys.stdout.write("script ended\n")
