package scheduler

import (
	"context"
	"fmt"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	fwk "k8s.io/kube-scheduler/framework"
	"k8s.io/kubernetes/pkg/scheduler/framework"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// BenchmarkPreemption1000Nodes is the plugin's part of one preemption
// cycle on 1,000 nodes of 8 GPUs, each GPU shared by two priority-0
// halves: what DefaultPreemption's SelectVictimsOnNode asks of it on
// every node (a clone of the cycle state, every lower-priority pod
// removed, Filter, then each pod added back with Filter, and removed
// again where the preemptor no longer fits), for a priority-1000 half.
// kube-scheduler runs the nodes on 16 goroutines; this runs them one
// after another. The baseline, in the same run, is one Filter of the
// same pod on every node, as a scheduling cycle without preemption does.
func BenchmarkPreemption1000Nodes(b *testing.B) {
	const nodes, gpus = 1000, 8
	p := &Plugin{args: testArgs(), cache: NewCache(testArgs())}
	infos := make([]*framework.NodeInfo, nodes)
	tenants := make([][]fwk.PodInfo, nodes)
	for i := range nodes {
		name := fmt.Sprintf("n%04d", i)
		n := node(name, gpus, 81920, true)
		p.cache.SetNode(n)
		infos[i] = framework.NewNodeInfo()
		infos[i].SetNode(n)
		for g := range gpus {
			group, uuid := fmt.Sprintf("g%d", g), fmt.Sprintf("GPU-%04d-%d", i, g)
			r := reservationPod(name, group, uuid)
			r.Spec.Containers[0].Resources.Requests = corev1.ResourceList{api.ResourceGPU: *resource.NewQuantity(1, resource.DecimalSI)}
			p.cache.SetPod(r)
			infos[i].AddPod(r)
			for k := range 2 {
				pod := placedPod(fmt.Sprintf("%s-%d-%d", name, g, k), name, 40960, api.TimeSlicing, "", []string{group}, []string{uuid})
				p.cache.SetPod(pod)
				infos[i].AddPod(pod)
				pi, err := framework.NewPodInfo(pod)
				if err != nil {
					b.Fatal(err)
				}
				tenants[i] = append(tenants[i], pi)
			}
		}
	}
	ctx := context.Background()
	state := cycleFor(ask("preemptor", 40960, api.TimeSlicing, 1))
	b.Run("filter", func(b *testing.B) {
		for b.Loop() {
			for _, info := range infos {
				if p.Filter(ctx, state, nil, info).IsSuccess() {
					b.Fatal("a full node took the preemptor")
				}
			}
		}
	})
	b.Run("preemption", func(b *testing.B) {
		for b.Loop() {
			for i, info := range infos {
				s := state.Clone()
				for _, pi := range tenants[i] {
					_ = p.RemovePod(ctx, s, nil, pi, info)
				}
				if !p.Filter(ctx, s, nil, info).IsSuccess() {
					b.Fatal("the preemptor does not fit an emptied node")
				}
				victims := 0
				for _, pi := range tenants[i] {
					_ = p.AddPod(ctx, s, nil, pi, info)
					if !p.Filter(ctx, s, nil, info).IsSuccess() {
						_ = p.RemovePod(ctx, s, nil, pi, info)
						victims++
					}
				}
				if victims != 1 {
					b.Fatalf("%d victims on %s, want 1", victims, info.Node().Name)
				}
			}
		}
	})
}
