package dashboard

import (
	"bufio"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/api/apitest"
	"github.com/gpufrac/gpufrac/pkg/clusterview"
)

func node(name string) *corev1.Node {
	return apitest.GPUNode(name, api.Inventory{Count: 2, MemoryMiB: 81920, Model: "NVIDIA-H100-80GB-HBM3"}, "driver", true)
}

// tenant is placed by another scheduler, with a limit of twice its request.
func tenant(name string, mib int64, uuid string) *corev1.Pod {
	a := api.Assignment{Container: "main", Devices: []string{uuid}, RequestMiB: mib, LimitMiB: 2 * mib, Mode: api.TimeSlicing}
	p := apitest.Placed("team", name, "n1", a)
	p.UID = ""
	return p
}

func pending(name string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "team", UID: types.UID("uid-" + name), Annotations: map[string]string{api.KeyFraction: "0.5"}}}
	p.Spec.Containers = []corev1.Container{{Name: "main"}}
	return p
}

// serve runs the dashboard over client on a loopback port until the test
// ends and returns its base URL once it has synced.
func serve(t *testing.T, client *fake.Clientset) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- New(Options{Client: client, Settle: 10 * time.Millisecond}).Run(ctx, l)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	base := "http://" + l.Addr().String() + "/"
	for deadline := time.Now().Add(10 * time.Second); ; {
		resp, err := http.Get(base + "healthz")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return base
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the dashboard did not sync: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// /api/view has the very numbers `gpufrac top -o json` prints for the same
// pods and nodes (clusterview.Build), and the pending pod's reason from
// the scheduler's event.
func TestViewIsTopsView(t *testing.T) {
	n := node("n1")
	pods := []*corev1.Pod{tenant("big", 40960, "GPU-a"), tenant("small", 20480, "GPU-a"), pending("waiting")}
	event := &corev1.Event{ObjectMeta: metav1.ObjectMeta{Name: "waiting.1", Namespace: "team"}, Reason: "FailedScheduling",
		Message: "0/1 nodes are available: 1 no GPU has 40960Mi free", InvolvedObject: corev1.ObjectReference{Kind: "Pod", Namespace: "team", Name: "waiting", UID: "uid-waiting"},
		LastTimestamp: metav1.Now()}
	client := fake.NewClientset(n, pods[0], pods[1], pods[2], event)
	base := serve(t, client)

	resp, err := http.Get(base + "api/view")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	var got clusterview.View
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
		t.Fatal(err)
	}
	top := clusterview.Build([]corev1.Node{*n}, []corev1.Pod{*pods[0], *pods[1], *pods[2]}, nil)
	raw, _ := json.Marshal(top)
	var want clusterview.View
	if err := json.Unmarshal(raw, &want); err != nil {
		t.Fatal(err)
	}
	want.Pending[0].Reason = event.Message
	if !reflect.DeepEqual(got, want) {
		t.Errorf("/api/view:\n%+v\nwant top's:\n%+v", got, want)
	}
	if got.Summary.AllocatedMiB != 61440 || got.Nodes[0].Shared[0].FreeMiB != 20480 {
		t.Errorf("figures: %+v", got.Summary)
	}
	if csp := resp.Header.Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") {
		t.Errorf("CSP %q", csp)
	}
}

// The stream sends the view at once, then each change; the dashboard
// takes no writes.
func TestStreamPushesChanges(t *testing.T) {
	client := fake.NewClientset(node("n1"), tenant("big", 40960, "GPU-a"))
	base := serve(t, client)
	resp, err := http.Get(base + "api/stream")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("Content-Type %q", ct)
	}
	events := make(chan clusterview.View)
	go func() {
		defer close(events)
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
				var v clusterview.View
				if json.Unmarshal([]byte(data), &v) == nil {
					events <- v
				}
			}
		}
	}()
	next := func() clusterview.View {
		t.Helper()
		select {
		case v, ok := <-events:
			if !ok {
				t.Fatal("the stream ended")
			}
			return v
		case <-time.After(10 * time.Second):
			t.Fatal("no view on the stream")
		}
		return clusterview.View{}
	}
	if v := next(); len(v.Nodes[0].Shared[0].Tenants) != 1 {
		t.Fatalf("first view: %+v", v.Nodes[0].Shared)
	}
	if _, err := client.CoreV1().Pods("team").Create(context.Background(), tenant("small", 20480, "GPU-a"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if v := next(); len(v.Nodes[0].Shared[0].Tenants) != 2 || v.Nodes[0].Shared[0].FreeMiB != 20480 {
		t.Fatalf("after a create: %+v", v.Nodes[0].Shared)
	}
	if err := client.CoreV1().Pods("team").Delete(context.Background(), "big", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if v := next(); len(v.Nodes[0].Shared[0].Tenants) != 1 || v.Nodes[0].Shared[0].Tenants[0].Pod != "team/small" {
		t.Fatalf("after a delete: %+v", v.Nodes[0].Shared)
	}

	post, err := http.Post(base+"api/view", "application/json", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	_ = post.Body.Close()
	if post.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /api/view: %d, want 405", post.StatusCode)
	}
}

// Every page file is served from the binary, with its type.
func TestServesTheEmbeddedPage(t *testing.T) {
	base := serve(t, fake.NewClientset())
	for path, want := range map[string]string{"": "text/html", "app.js": "text/javascript", "style.css": "text/css"} {
		resp, err := http.Get(base + path)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), want) {
			t.Errorf("/%s: %d %q", path, resp.StatusCode, resp.Header.Get("Content-Type"))
		}
	}
}

// On a loopback address only a loopback Host is answered: a web page that
// rebinds its own name to 127.0.0.1 reads nothing.
func TestLoopbackAnswersOnlyLoopbackHosts(t *testing.T) {
	base := serve(t, fake.NewClientset(node("n1")))
	for host, want := range map[string]int{
		"": http.StatusOK, "localhost:8080": http.StatusOK, "[::1]:8080": http.StatusOK,
		"attacker.example": http.StatusMisdirectedRequest, "attacker.example:8080": http.StatusMisdirectedRequest,
	} {
		req, err := http.NewRequest(http.MethodGet, base+"api/view", nil)
		if err != nil {
			t.Fatal(err)
		}
		if host != "" {
			req.Host = host
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("Host %q: %d, want %d", host, resp.StatusCode, want)
		}
	}
	resp, err := http.Get(base + "livez")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/livez: %d", resp.StatusCode)
	}
}

// On a cluster that serves ResourceClaims, a claim's DRA share shows on
// its GPU beside the pods', as in `gpufrac top`.
func TestViewShowsClaimShares(t *testing.T) {
	device, _ := api.DRADeviceName("GPU-a", api.TimeSlicing)
	claim := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: "team", UID: "uid-c"}}
	claim.Status.Allocation = &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
		Request: "gpu", Driver: api.DRADriver, Pool: "n1", Device: device,
		ConsumedCapacity: map[resourceapi.QualifiedName]resource.Quantity{api.DRACapacityMemory: resource.MustParse("10Gi")},
	}}}}
	client := fake.NewClientset(node("n1"), tenant("big", 40960, "GPU-a"), claim)
	client.Resources = []*metav1.APIResourceList{{GroupVersion: "resource.k8s.io/v1", APIResources: []metav1.APIResource{{Name: "resourceclaims", Namespaced: true, Kind: "ResourceClaim"}}}}
	base := serve(t, client)
	resp, err := http.Get(base + "api/view")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	var got clusterview.View
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
		t.Fatal(err)
	}
	if len(got.Nodes) != 1 || len(got.Nodes[0].Shared) != 1 {
		t.Fatalf("view: %+v", got)
	}
	var claims, pods int
	for _, ten := range got.Nodes[0].Shared[0].Tenants {
		if ten.Claim {
			claims++
			if ten.Pod != "team/c/gpu" || ten.RequestMiB != 10240 {
				t.Errorf("claim tenant %+v", ten)
			}
		} else {
			pods++
		}
	}
	if claims != 1 || pods != 1 || got.Summary.AllocatedMiB != 40960+10240 {
		t.Errorf("GPU-a: %d claims and %d pods, %dMi allocated; want one of each, 51200Mi", claims, pods, got.Summary.AllocatedMiB)
	}
}

// Wherever it listens (a pod's address behind kubectl port-forward, a
// Service), the dashboard answers only loopback Hosts and its allowed
// names: a web page that rebinds its own name to the forwarded address
// reads nothing. The probes answer any Host (the kubelet names the pod).
func TestOnlyAllowedHostsAreAnswered(t *testing.T) {
	s := New(Options{Client: fake.NewClientset(), AllowedHosts: []string{"gpufrac-dashboard.gpufrac-system.svc"}})
	h := s.Handler()
	for _, tc := range []struct {
		host, path string
		refused    bool
	}{
		{"attacker.example", "/api/view", true},
		{"10.0.0.7:8080", "/", true},
		{"gpufrac-dashboard.gpufrac-system.svc", "/api/view", false},
		{"GPUFRAC-DASHBOARD.gpufrac-system.svc:80", "/api/view", false},
		{"localhost:8080", "/api/view", false},
		{"10.0.0.7:8080", "/livez", false},
		{"10.0.0.7:8080", "/healthz", false},
	} {
		req := httptest.NewRequest(http.MethodGet, "http://"+tc.host+tc.path, nil)
		req.Host = tc.host
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if refused := rec.Code == http.StatusMisdirectedRequest; refused != tc.refused {
			t.Errorf("Host %q %s: %d, want refused %v", tc.host, tc.path, rec.Code, tc.refused)
		}
	}
}
