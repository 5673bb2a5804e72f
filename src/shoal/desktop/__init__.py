"""Computer-use desktops (docs/desktop.md): screenshots from Xvfb's framebuffer (screen.py), the
action space and its pyautogui / E2B spellings (actions.py), operations over any backend (ops.py).
The images are built in shoal.envs.desktop; the SDK surface is shoal.sdk.desktop."""

STATE_DIR = "/tmp/.shoal-desktop"  # the helper's pid files, logs, the bus socket (inside the sandbox)
FB_PATH = STATE_DIR + "/fb/Xvfb_screen0"  # Xvfb -fbdir: the screen as an mmap'd XWD file
HELPER = "/usr/local/bin/shoal-desktop"  # the in-sandbox helper (envs/desktop_files/shoal-desktop)
DEVTOOLS_PORT = 9222  # the browser layer's Chromium DevTools port: the grader's alone (backend guard_port)
# the helper runs isolated (-I: no PYTHON* variables, no user site, no script directory on the path)
HELPER_ARGV = ("/usr/bin/python3", "-I", HELPER)
