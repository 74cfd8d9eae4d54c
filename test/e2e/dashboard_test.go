package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpufrac/gpufrac/internal/checkout"
	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/clusterview"
)

// apiView is the dashboard's view as its /api/view serves it.
func apiView(t *testing.T, base string) clusterview.View {
	t.Helper()
	resp, err := http.Get(base + "api/view")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	var v clusterview.View
	if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

// chromium is Debian's Chromium ($CHROMIUM, or on PATH), which `make
// test` installs; missing, the test fails and says how to get it.
func chromium(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("CHROMIUM"); p != "" {
		return p
	}
	p, err := exec.LookPath("chromium")
	if err != nil {
		t.Fatalf("no chromium on PATH (nor $CHROMIUM): run `make chromium` (Debian's package), which `make test` does")
	}
	return p
}

// mib is how the page prints MiB: as top does.
func mib(v int64) string {
	if v != 0 && v%1024 == 0 {
		return fmt.Sprintf("%dGi", v/1024)
	}
	return fmt.Sprintf("%dMi", v)
}

// The dashboard in a real browser (headless Chromium) against a local
// cluster: it shows the examples' tenants with the free memory the view
// has, a tenant's annotations on a click, a new pod as it is placed and a
// deleted one as it goes without a reload, a pending pod with the
// scheduler's reason, and fits a phone's width. The screenshot is saved
// in the test's artifact directory (go test -artifacts keeps it) and at
// $GPUFRAC_SCREENSHOT when set (docs/dashboard.png, for the README; a
// relative path is from the repository's root).
func TestDashboardInABrowser(t *testing.T) {
	browser := chromium(t)
	c, _ := up(t, 2)
	ctx := context.Background()
	root, err := checkout.Root()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Demo(ctx, filepath.Join(root, "examples"), io.Discard); err != nil {
		t.Fatal(err)
	}

	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(browser), chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.UserDataDir(t.TempDir()), chromedp.WindowSize(1280, 900),
		// This machine's network is closed: no background fetches.
		chromedp.Flag("disable-background-networking", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.Flag("disable-quic", true), chromedp.Flag("no-first-run", true))
	alloc, cancelAlloc := chromedp.NewExecAllocator(ctx, opts...)
	defer cancelAlloc()
	page, cancelPage := chromedp.NewContext(alloc)
	defer cancelPage()
	page, cancel := context.WithTimeout(page, 3*time.Minute)
	defer cancel()

	tenant := func(pod string) chromedp.CSS { return chromedp.CSS(`.tenants li[data-pod="` + pod + `"]`) }
	// text reads an element's text in one step of the page's own script:
	// the page is redrawn whenever a reading of use arrives, and a query
	// then a read (chromedp.Text) can find the element gone in between.
	text := func(sel chromedp.CSS) string {
		t.Helper()
		js := fmt.Sprintf(`(() => { const e = document.querySelector(%q); return e === null ? null : e.innerText; })()`, string(sel))
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			got, err := chromedp.Run(page, chromedp.Evaluate[*string](js))
			if err == nil && got != nil {
				return *got
			}
			if time.Now().After(deadline) {
				t.Fatalf("text of %s: %v (found %v)", sel, err, got != nil)
			}
		}
	}
	if err := chromedp.Do(page,
		chromedp.Navigate(c.DashboardURL),
		chromedp.WaitVisible(tenant("default/fraction-half")),
		chromedp.Click(tenant("default/fraction-half")+" summary"),
		chromedp.WaitVisible(tenant("default/fraction-half")+" dl dt"),
	); err != nil {
		t.Fatalf("the page: %v", err)
	}
	// The page shows the server's view (/api/view, top's figures): both
	// settle a moment after the demo's last pod, so compare until they
	// agree, or say how they differ.
	var halfGPU clusterview.GPU
	var gotGPU, wantGPU, gotFree, wantFree string
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(300 * time.Millisecond) {
		view := apiView(t, c.DashboardURL)
		halfGPU = clusterview.GPU{}
		for _, n := range view.Nodes {
			for _, g := range n.Shared {
				for _, tn := range g.Tenants {
					if tn.Pod == "default/fraction-half" {
						halfGPU = g
					}
				}
			}
		}
		if halfGPU.UUID == "" {
			t.Fatalf("/api/view has no default/fraction-half: %+v", view)
		}
		wantGPU, wantFree = "free "+mib(halfGPU.FreeMiB)+" of "+mib(halfGPU.SchedulableMiB), mib(view.Summary.FreeMiB)
		gotGPU, gotFree = text(chromedp.CSS(`.gpu[data-uuid="`+halfGPU.UUID+`"] .free`)), text(`#fig-free dd`)
		if strings.HasPrefix(gotGPU, wantGPU) && gotFree == wantFree || time.Now().After(deadline) {
			break
		}
	}
	if !strings.HasPrefix(gotGPU, wantGPU) {
		t.Errorf("fraction-half's GPU says %q, want %q…", gotGPU, wantGPU)
	}
	if gotFree != wantFree {
		t.Errorf("the summary's free memory is %q, want %q", gotFree, wantFree)
	}
	if got := text(tenant("default/fraction-half") + " dl"); !strings.Contains(got, api.ContainerKey("main", api.SuffixDevices)) || !strings.Contains(got, halfGPU.UUID) {
		t.Errorf("fraction-half's annotations on the page: %q", got)
	}
	if _, err := chromedp.Run(page, chromedp.Evaluate[bool](`window.notReloaded = true`)); err != nil {
		t.Fatal(err)
	}

	// Use against grant, as the simulated GPUs report it: the page says
	// what the view says, the figure changes as the use does (the model's
	// readings differ from one resync to the next), and the history grows.
	used := tenant("default/fraction-half") + " .used"
	usedNow := func() string { return text(used) }
	first := usedNow()
	if !strings.HasPrefix(first, "used ") || !strings.Contains(first, " of ") {
		t.Errorf("fraction-half's use on the page: %q, want \"used … of …\"", first)
	}
	var later string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(500 * time.Millisecond) {
		if later = usedNow(); later != first || time.Now().After(deadline) {
			break
		}
	}
	if later == first {
		t.Errorf("fraction-half's use stayed %q for 30 s: the page does not follow the readings", first)
	}
	for _, tn := range apiView(t, c.DashboardURL).Nodes {
		for _, g := range tn.Shared {
			for _, x := range g.Tenants {
				if x.Pod == "default/fraction-half" && (x.Use == nil || x.Use.UsedMiB == nil || len(x.History) < 2) {
					t.Errorf("/api/view: fraction-half's use %+v, %d readings of history", x.Use, len(x.History))
				}
			}
		}
	}
	if samples, err := chromedp.Run(page, chromedp.Evaluate[int](`Number(document.querySelector('`+string(tenant("default/fraction-half"))+` svg.spark').dataset.samples)`)); err != nil || samples < 2 {
		t.Errorf("fraction-half's history on the page: %d readings (%v), want 2 or more", samples, err)
	}
	if gpuUse := text(chromedp.CSS(`.gpu[data-uuid="` + halfGPU.UUID + `"] .gpu-use`)); !strings.HasPrefix(gpuUse, "in use ") {
		t.Errorf("fraction-half's GPU's use: %q", gpuUse)
	}

	// A share that holds most of its limit, above its request, is named
	// first to be reclaimed on its GPU, as /api/view (top's order) says.
	greedy := pod("greedy", map[string]string{api.KeyMemory: "4096", api.KeyMemoryLimit: "8Gi", api.SimulatedLoadAnnotation: "greedy"})
	if _, err := c.Admin.CoreV1().Pods("default").Create(ctx, greedy, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var greedyGPU, reclaim string
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(500 * time.Millisecond) {
		for _, n := range apiView(t, c.DashboardURL).Nodes {
			for _, g := range n.Shared {
				if slices.Contains(g.ReclaimOrder, "default/greedy") {
					greedyGPU = g.UUID
				}
			}
		}
		if greedyGPU == "" {
			continue
		}
		// Read in one step of the page's script, which may redraw it.
		got, err := chromedp.Run(page, chromedp.Evaluate[string](`(document.querySelector('.gpu[data-uuid="`+greedyGPU+`"] .reclaim') || {textContent: ""}).textContent`))
		if reclaim = got; err == nil && strings.Contains(reclaim, "default/greedy") {
			break
		}
	}
	if !strings.HasPrefix(reclaim, "reclaimed first if short of memory: ") || !strings.Contains(reclaim, "default/greedy") {
		t.Errorf("greedy's GPU %q says %q, want it named first to be reclaimed", greedyGPU, reclaim)
	}

	// A pod appears once placed, and goes once deleted, without a reload.
	if _, err := c.Admin.CoreV1().Pods("default").Create(ctx, pod("live-one", map[string]string{api.KeyFraction: "0.1"}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// One that no node can take waits, with the scheduler's reason.
	stuck := pod("stuck", map[string]string{api.KeyFraction: "0.5"})
	stuck.Spec.NodeSelector = map[string]string{"no-such-label": "x"}
	if _, err := c.Admin.CoreV1().Pods("default").Create(ctx, stuck, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	const stuckReason = `#pending-list li[data-pod="default/stuck"] .reason`
	if err := chromedp.Do(page,
		chromedp.WaitVisible(tenant("default/live-one")),
		chromedp.WaitVisible(chromedp.CSS(stuckReason)),
	); err != nil {
		t.Fatalf("the new pods on the page: %v", err)
	}
	if _, err := chromedp.Run(page, chromedp.Poll[bool](`document.querySelector('`+stuckReason+`').textContent.startsWith("scheduler: ")`)); err != nil {
		t.Fatalf("the pending pod's reason: %v", err)
	}
	if reason := text(stuckReason); !strings.Contains(reason, "node(s) didn't match Pod's node affinity/selector") {
		t.Errorf("the pending pod's reason: %q", reason)
	}
	if err := c.Admin.CoreV1().Pods("default").Delete(ctx, "live-one", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := chromedp.Do(page, chromedp.WaitNotPresent(tenant("default/live-one"))); err != nil {
		t.Fatalf("the deleted pod on the page: %v", err)
	}
	if notReloaded, err := chromedp.Run(page, chromedp.Evaluate[bool](`window.notReloaded === true`)); err != nil || !notReloaded {
		t.Errorf("the page was reloaded to show the changes (%v)", err)
	}
	screenshot, err := chromedp.Run(page, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{filepath.Join(t.ArtifactDir(), "dashboard.png"), os.Getenv("GPUFRAC_SCREENSHOT")} {
		if path == "" {
			continue
		}
		if !filepath.IsAbs(path) {
			path = filepath.Join(root, path) // go test runs in test/e2e
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, screenshot, 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("screenshot: %s", path)
	}

	// At a phone's width nothing needs sideways scrolling.
	if err := chromedp.Do(page, chromedp.EmulateViewport(390, 844), chromedp.Sleep(200*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if fits, err := chromedp.Run(page, chromedp.Evaluate[bool](`document.documentElement.scrollWidth <= window.innerWidth`)); err != nil || !fits {
		t.Errorf("the page is wider than a phone's 390 px (%v)", err)
	}
}
