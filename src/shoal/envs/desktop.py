"""Desktop (computer-use) images from recipes: a base desktop and one toolkit layer per app.

    desktop:bookworm            base: Debian + Xvfb, openbox, xdotool, wmctrl, AT-SPI, GTK 3, fonts
    desktop-helper:1            toolkit: the in-sandbox helper /usr/local/bin/shoal-desktop (always composed)
    desktop-app/<app>:1         toolkit: one Debian app (editor = mousepad, spreadsheet = gnumeric,
                                files = thunar, browser = chromium) and its launcher entry
    desktop-variant/icewm:1     toolkit: the Robustness variant (icewm instead of openbox, 1024x768,
                                a dark GTK theme, another background)

They compose at creation like any Shoal layers:

    ensure_desktop(host, apps=("editor", "spreadsheet"))
    Sandbox.create(DESKTOP_IMAGE, layers=desktop_layers(["editor", "spreadsheet"]))

Each app layer writes only its own /etc/shoal-desktop/apps.d/<app>.json, so any set of them can be
stacked. Builds go through the Builder, so each recipe step is cached per host (an unchanged recipe
rebuilds nothing)."""
from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import InvalidArgument
from ..desktop import STATE_DIR
from ..host import Host
from ..layers.store import ImageInfo
from .builder import Builder
from .debian import BASE_IMAGE, ensure_debian_base
from .recipe import parse_recipe

DESKTOP_IMAGE = "desktop:bookworm"
CONTEXT = Path(__file__).with_name("desktop_files")
# what every process in a desktop sandbox needs to reach the X server and the session bus
DESKTOP_ENV = {"DISPLAY": ":0", "DBUS_SESSION_BUS_ADDRESS": f"unix:path={STATE_DIR}/bus",
               "XDG_RUNTIME_DIR": STATE_DIR, "NO_AT_BRIDGE": "0", "GTK_A11Y": "atspi",
               "LANG": "C.UTF-8", "HOME": "/root"}

_APT = "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends"

BASE_PACKAGES = ("xvfb", "openbox", "xdotool", "wmctrl", "x11-xserver-utils", "dbus", "at-spi2-core",
                 "libatk-adaptor", "python3", "python3-gi", "gir1.2-atspi-2.0", "libgtk-3-0", "fonts-dejavu-core",
                 "xfonts-base")


CHROMIUM_POLICY = "/etc/chromium/policies/managed/shoal.json"
# devtools://*: the DevTools window (F12, ctrl+shift+j), whose console would run script in the graded
# page; the remote debugging port the checker uses stays open (DeveloperToolsAvailability=2 would close it)
CHROMIUM_BLOCKLIST = ("javascript://*", "javascript:*", "data:*", "data://*", "devtools://*")
CHROMIUM_POLICY_JSON = json.dumps({"URLBlocklist": list(CHROMIUM_BLOCKLIST),
                                   "ExtensionInstallBlocklist": ["*"]})  # no extension the agent wrote


@dataclass(frozen=True)
class DesktopApp:
    name: str  # what `sb.desktop.launch(name)` takes
    packages: tuple[str, ...]
    argv: tuple[str, ...]  # the launch command (absolute program path)
    files: tuple[tuple[str, str], ...] = ()  # (path, content) the layer writes beside the package

    @property
    def image(self) -> str:
        return f"desktop-app/{self.name}:1"


APPS: dict[str, DesktopApp] = {a.name: a for a in (
    DesktopApp("editor", ("mousepad",), ("/usr/bin/mousepad",)),
    DesktopApp("spreadsheet", ("gnumeric",), ("/usr/bin/gnumeric",)),
    DesktopApp("files", ("thunar",), ("/usr/bin/thunar",)),
    # chromium's own sandbox needs user namespaces, which the Shoal sandbox withholds; the debugging
    # port listens on the sandbox's loopback only (its own network namespace); ACCESSIBILITY_ENABLED
    # puts web content in the AT-SPI tree (the flag alone exposed only the window)
    DesktopApp("browser", ("chromium",), ("/usr/bin/env", "ACCESSIBILITY_ENABLED=1", "/usr/bin/chromium",
                                          "--no-sandbox", "--no-first-run", "--disable-gpu",
                                          "--disable-dev-shm-usage", "--force-renderer-accessibility",
                                          "--password-store=basic", "--remote-debugging-address=127.0.0.1",
                                          "--remote-debugging-port=9222", "--user-data-dir=/root/.chromium-shoal"),
               # a managed policy (the agent cannot lift it from the UI): no javascript: URL typed into the
               # omnibox to rewrite the graded page, no data: page to forge one, no DevTools window, no
               # extensions (docs/desktop.md, "Grader hardening")
               files=((CHROMIUM_POLICY, CHROMIUM_POLICY_JSON),)),
)}
VARIANT_IMAGE = "desktop-variant/icewm:1"
VNC_IMAGE = "desktop-vnc:1"  # x11vnc, for a person watching (shoal.desktop.vnc); composed on request
HELPER_IMAGE = "desktop-helper:1"


def base_recipe() -> str:
    env = " ".join(f"{k}={v}" for k, v in DESKTOP_ENV.items())
    return f"""
FROM {BASE_IMAGE}
LABEL shoal.role=base
ENV {env}
RUN {_APT} {' '.join(BASE_PACKAGES)} && apt-get clean
RUN mkdir -p /etc/shoal-desktop/apps.d /root && \\
    printf 'size=1280x800\\nwm=openbox\\nbackground=#2e3440\\n' > /etc/shoal-desktop/desktop.conf
"""


def helper_recipe() -> str:
    # its own layer, so that a change to the helper rebuilds neither the base nor any app
    return f"""
FROM {DESKTOP_IMAGE}
LABEL shoal.role=toolkit
COPY shoal-desktop /usr/local/bin/shoal-desktop
"""


def app_recipe(app: DesktopApp) -> str:
    entry = json.dumps({app.name: list(app.argv)})
    # a step of its own: a change to these files reuses the cached package install before it
    files = "".join(f"RUN mkdir -p {shlex.quote(str(Path(path).parent))} && "
                    f"printf '%s\\n' {shlex.quote(content)} > {shlex.quote(path)}\n" for path, content in app.files)
    return f"""
FROM {DESKTOP_IMAGE}
LABEL shoal.role=toolkit
RUN {_APT} {' '.join(app.packages)} && apt-get clean && \\
    printf '%s\\n' {shlex.quote(entry)} > /etc/shoal-desktop/apps.d/{app.name}.json
{files}"""


def variant_recipe() -> str:
    return f"""
FROM {DESKTOP_IMAGE}
LABEL shoal.role=toolkit
RUN {_APT} icewm && apt-get clean && mkdir -p /etc/gtk-3.0 && \\
    printf 'size=1024x768\\nwm=icewm\\nbackground=#5e3a1c\\n' > /etc/shoal-desktop/desktop.conf && \\
    printf '[Settings]\\ngtk-application-prefer-dark-theme=1\\ngtk-font-name=DejaVu Serif 11\\n' \\
      > /etc/gtk-3.0/settings.ini
"""


def vnc_recipe() -> str:
    return f"""
FROM {DESKTOP_IMAGE}
LABEL shoal.role=toolkit
RUN {_APT} x11vnc && apt-get clean
"""


def ensure_desktop(host: Host, apps: tuple[str, ...] | list[str] = ("editor", "spreadsheet", "files", "browser"),
                   variant: bool = False, log: Callable[[str], None] | None = None,
                   vnc: bool = False) -> list[ImageInfo]:
    """Build (or find in the cache) the desktop base and the toolkit layers of `apps` (+ the
    Robustness variant); returns the images, base first."""
    unknown = [a for a in apps if a not in APPS]
    if unknown:
        raise InvalidArgument(f"unknown desktop app(s) {unknown}; known: {sorted(APPS)}")
    ensure_debian_base(host, log=log)
    b = Builder(host, on_output=log)
    out = [b.build(parse_recipe(base_recipe(), CONTEXT, name="desktop base"), DESKTOP_IMAGE).image,
           b.build(parse_recipe(helper_recipe(), CONTEXT, name="desktop helper"), HELPER_IMAGE).image]
    for a in apps:
        out.append(b.build(parse_recipe(app_recipe(APPS[a]), CONTEXT, name=f"desktop app {a}"), APPS[a].image).image)
    if variant:
        out.append(b.build(parse_recipe(variant_recipe(), CONTEXT, name="desktop variant"), VARIANT_IMAGE).image)
    if vnc:
        out.append(b.build(parse_recipe(vnc_recipe(), CONTEXT, name="desktop vnc"), VNC_IMAGE).image)
    return out


def desktop_layers(apps: tuple[str, ...] | list[str] = (), variant: bool = False, vnc: bool = False) -> list[str]:
    """The layers to compose on DESKTOP_IMAGE for these apps (and the Robustness variant, x11vnc)."""
    unknown = [a for a in apps if a not in APPS]
    if unknown:
        raise InvalidArgument(f"unknown desktop app(s) {unknown}; known: {sorted(APPS)}")
    return [HELPER_IMAGE] + [APPS[a].image for a in apps] + ([VARIANT_IMAGE] if variant else []) + \
        ([VNC_IMAGE] if vnc else [])
