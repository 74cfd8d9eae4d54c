package agent

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	corev1listers "k8s.io/client-go/listers/core/v1"
	k8stesting "k8s.io/client-go/testing"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"

	"github.com/gpufrac/gpufrac/pkg/node/inventory"
	"github.com/gpufrac/gpufrac/pkg/node/usage"
)

// reclaimAgent is an agent over one 80 GiB GPU whose node runs the given
// pods, with a fake API server and event recorder.
func reclaimAgent(t *testing.T, pods ...*corev1.Pod) (*Agent, *fake.Clientset, *record.FakeRecorder, hardware) {
	t.Helper()
	indexer := toolscache.NewIndexer(toolscache.MetaNamespaceKeyFunc, toolscache.Indexers{toolscache.NamespaceIndex: toolscache.MetaNamespaceIndexFunc})
	client := fake.NewClientset()
	for _, p := range pods {
		if err := indexer.Add(p); err != nil {
			t.Fatal(err)
		}
		if _, err := client.CoreV1().Pods(p.Namespace).Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	a := New(Options{NodeName: "n1"}, client)
	a.pods = &podWatch{lister: corev1listers.NewPodLister(indexer), synced: func() bool { return true }}
	rec := record.NewFakeRecorder(10)
	a.recorder = rec
	hw := hardware{inv: inventory.Inventory{GPUs: []inventory.GPU{{UUID: "GPU-0", MemoryMiB: 81920}}}}
	return a, client, rec, hw
}

func tenantPod(name string, priority int32) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name, UID: types.UID("uid-" + name)},
		Spec: corev1.PodSpec{NodeName: "n1", Priority: &priority}}
}

// used is a container of pod on GPU-0 using mib, with a request of 4 GiB.
func used(name string, mib int64) usage.Container {
	return usage.Container{Tenant: usage.Tenant{Namespace: "ns", Pod: name, UID: "uid-" + name, Container: "main", RequestMiB: 4096, LimitMiB: 16384},
		GPU: "GPU-0", MemoryBytes: usage.Figure{Value: mib << 20, Known: true}}
}

func reading(hostMiB int64, containers ...usage.Container) usage.Measurement {
	total := hostMiB
	for _, c := range containers {
		total += c.MemoryBytes.Value >> 20
	}
	return usage.Measurement{Containers: containers, GPUs: []usage.GPU{{UUID: "GPU-0", MemoryBytes: usage.Figure{Value: total << 20, Known: true}}}}
}

func deleted(client *fake.Clientset) []string {
	var out []string
	for _, a := range client.Actions() {
		if d, ok := a.(k8stesting.DeleteAction); ok {
			out = append(out, d.GetName())
		}
	}
	return out
}

// Under memory pressure the lowest-priority tenant above its request is
// stopped first, with an event naming the pressure and the order; then
// nothing more while its pod is being deleted; then, if the GPU is still
// short, the next; never one within its request, and never while the
// GPU has memory to spare.
func TestBurstReclaimStopsTheLowestPriorityAboveItsRequest(t *testing.T) {
	ctx, logger := context.Background(), klog.Background()
	a, client, rec, hw := reclaimAgent(t, tenantPod("prod", 1000), tenantPod("notebook", 0), tenantPod("within", -5))
	// 80 GiB: the three use 12 + 8 + 4 GiB and the host 54 GiB: 2 GiB free.
	m := reading(55296, used("prod", 12288), used("notebook", 8192), used("within", 4096))
	a.reclaimBursts(ctx, logger, hw, m)
	if got := deleted(client); len(got) != 1 || got[0] != "notebook" {
		t.Fatalf("deleted %v, want notebook (priority 0, above its request; prod is 1000, within is within its request)", got)
	}
	event := <-rec.Events
	for _, want := range []string{"GPUMemoryReclaimed", "GPU GPU-0 has 2Gi free of 80Gi, below 5%", "ns/notebook (priority 0, 4Gi above its request); ns/prod (priority 1000, 8Gi above its request)"} {
		if !strings.Contains(event, want) {
			t.Errorf("event %q does not say %q", event, want)
		}
	}
	if strings.Contains(event, "ns/within") {
		t.Errorf("event %q lists a tenant within its request", event)
	}
	a.reclaimBursts(ctx, logger, hw, m)
	if got := deleted(client); len(got) != 1 {
		t.Fatalf("deleted %v while the first victim was still going", got)
	}
	// notebook still holds its memory past its grace and the slack: its
	// memory will not come back by waiting, and the GPU is still short.
	a.reclaiming["uid-notebook"] = time.Now().Add(-a.opts.SecurityStopGrace - reclaimSlack - time.Second)
	a.reclaimBursts(ctx, logger, hw, m)
	if got := deleted(client); len(got) != 2 || got[1] != "prod" {
		t.Fatalf("deleted %v, want prod next", got)
	}
	// A pod being deleted that holds nothing on the GPU does not hold
	// reclaim back there.
	now := metav1.Now()
	going := tenantPod("going", 0)
	going.DeletionTimestamp = &now
	b, clientB, _, _ := reclaimAgent(t, tenantPod("notebook", 0), going)
	b.reclaimBursts(ctx, logger, hw, reading(70000, used("notebook", 8192), used("going", 0)))
	if got := deleted(clientB); len(got) != 1 || got[0] != "notebook" {
		t.Fatalf("deleted %v, want notebook: the pod being deleted holds no memory", got)
	}
	// Memory to spare: nobody.
	a2, client2, _, _ := reclaimAgent(t, tenantPod("notebook", 0))
	a2.reclaimBursts(ctx, logger, hw, reading(0, used("notebook", 16384)))
	if got := deleted(client2); len(got) != 0 {
		t.Fatalf("deleted %v on a GPU with 64 GiB free", got)
	}
	// Unknown use is not zero, nor over: nobody, even short of memory.
	unknown := used("notebook", 0)
	unknown.MemoryBytes = usage.Figure{}
	m = reading(80000, unknown)
	a2.reclaimBursts(ctx, logger, hw, m)
	if got := deleted(client2); len(got) != 0 {
		t.Fatalf("deleted %v on an unknown reading", got)
	}
	// Off: nobody.
	a3, client3, _, _ := reclaimAgent(t, tenantPod("notebook", 0))
	a3.opts.BurstReclaim = BurstReclaimOff
	a3.reclaimBursts(ctx, logger, hw, reading(70000, used("notebook", 8192)))
	if got := deleted(client3); len(got) != 0 {
		t.Fatalf("--burst-reclaim off deleted %v", got)
	}
}
