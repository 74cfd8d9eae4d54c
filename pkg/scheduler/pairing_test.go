package scheduler

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	fwk "k8s.io/kube-scheduler/framework"

	"github.com/gpufrac/gpufrac/pkg/api"
	"github.com/gpufrac/gpufrac/pkg/placement"
	"github.com/gpufrac/gpufrac/pkg/sim"
)

// The plugin's cache and scores, with kube-scheduler's normalisation and
// choice of the highest total, place a trace slice pod for pod as the
// simulator's given order does.
func TestPluginPlacesASliceAsTheSimulator(t *testing.T) {
	dir := filepath.Join("..", "..", "traces", "alibaba-gpu-v2023")
	load := func(name string) *os.File {
		f, err := os.Open(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = f.Close() })
		return f
	}
	nodes, err := sim.LoadNodes(load("openb_node_list_gpu_node.csv"), "nodes")
	if err != nil {
		t.Fatal(err)
	}
	pods, err := sim.LoadPods(load("openb_pod_list_default.csv"), "pods")
	if err != nil {
		t.Fatal(err)
	}
	slice, workload, err := sim.Slice(nodes, pods, "G2", 32, 42, 1.3)
	if err != nil {
		t.Fatal(err)
	}
	for _, policy := range []string{"gpufrac", "fgd"} {
		t.Run(policy, func(t *testing.T) {
			want, err := sim.Run(slice, workload, sim.Config{Policy: policy, Seed: 42, Given: true}, nil)
			if err != nil {
				t.Fatal(err)
			}
			c := NewCache(testArgs())
			hosts := map[string]*Host{}
			for _, n := range slice {
				node := node(n.Name, n.GPUs, 32000, true)
				node.Status.Allocatable[corev1.ResourceCPU] = *resource.NewMilliQuantity(n.CPUMilli, resource.DecimalSI)
				c.SetNode(node)
				hosts[n.Name] = &Host{CPU: n.CPUMilli, MemoryMiB: n.MemoryMiB}
			}
			asks := make([]Ask, len(workload))
			for i, p := range workload {
				pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: "replay", UID: types.UID(p.Name)},
					Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "main", Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
						corev1.ResourceCPU: *resource.NewMilliQuantity(p.CPUMilli, resource.DecimalSI), corev1.ResourceMemory: *resource.NewQuantity(p.MemoryMiB<<20, resource.BinarySI)}}}}}}
				switch {
				case p.Shares():
					pod.Annotations = map[string]string{api.KeyFraction: fmt.Sprintf("0.%03d", p.GPUMilli)}
				case p.NumGPU > 0:
					pod.Spec.Containers[0].Resources.Limits = corev1.ResourceList{api.ResourceGPU: *resource.NewQuantity(int64(p.NumGPU), resource.DecimalSI)}
				}
				c.SetPod(pod)
				asks[i] = Ask{UID: pod.UID, Whole: api.WholeGPUs(&pod.Spec)}
				asks[i].CPU, asks[i].MemoryMiB, _ = podRequests(pod)
				if reqs, _ := api.Parse(api.Intent(pod)); len(reqs) > 0 {
					asks[i].Fraction = &reqs[0]
				}
			}
			pol := NewTestPolicyNamed(t, c, policy)
			for i, ask := range asks {
				var scores fwk.NodeScoreList
				for _, n := range slice {
					h := hosts[n.Name]
					if h.CPUUsed+ask.CPU > h.CPU || h.MemoryUsedMiB+ask.MemoryMiB > h.MemoryMiB {
						continue
					}
					if ask.GPU() && !c.Filter(n.Name, ask).Fits {
						continue
					}
					s, ok := c.Score(n.Name, ask, pol, *h)
					if !ok {
						continue
					}
					scores = append(scores, fwk.NodeScore{Name: n.Name, Score: rawScore(s)})
				}
				got := ""
				if len(scores) > 0 {
					normalize(scores)
					for _, s := range scores {
						if s.Score == fwk.MaxScore {
							got = s.Name
						}
					}
					if err := c.Reserve(got, "replay", workload[i].Name, ask, pol, *hosts[got]); err != nil {
						t.Fatal(err)
					}
					hosts[got].CPUUsed += ask.CPU
					hosts[got].MemoryUsedMiB += ask.MemoryMiB
				}
				if got != want.Placed[i].Node {
					t.Fatalf("pod %d (%+v): placed on %q, the simulator on %q", i, workload[i], got, want.Placed[i].Node)
				}
			}
		})
	}
}

func NewTestPolicyNamed(t *testing.T, c *Cache, name string) placement.Policy {
	t.Helper()
	shapes, capacity, supply := c.Shapes()
	p, err := placement.New(name, shapes, capacity, supply, nil)
	if err != nil {
		t.Fatal(err)
	}
	return p
}
