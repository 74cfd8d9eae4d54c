//go:build soak

package soak

import (
	"context"
	"errors"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpufrac/gpufrac/pkg/api"
)

// shapes are the fractional pods the workload draws from: every mode,
// a fraction and an amount of memory, one and two GPUs.
var shapes = []map[string]string{
	{api.KeyFraction: "0.1"}, {api.KeyFraction: "0.25"}, {api.KeyFraction: "0.5"}, {api.KeyFraction: "0.75"},
	{api.KeyMemory: "8000"}, {api.KeyMemory: "20000"},
	{api.KeyFraction: "0.25", api.KeyComputeSharingMode: string(api.SMSharing)},
	{api.KeyFraction: "0.5", api.KeyComputeSharingMode: string(api.SMSharing)},
	{api.KeyFraction: "0.2", api.KeyNumDevices: "2"},
}

// Caps keep the load at about two thirds of the GPUs, so that a pod that
// fits is the rule and a pod that waits is a finding.
const (
	maxBare        = 30
	maxWhole       = 2
	maxDeployments = 3
	maxReplicas    = 4
	maxJobs        = 2
	maxClaimPods   = 3
)

// workload makes one random change every 0.2 to 0.8 s until ctx ends.
func (s *soak) workload(ctx context.Context) {
	seq := 0
	for ctx.Err() == nil {
		seq++
		s.step(ctx, seq)
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(200+s.rng.Intn(600)) * time.Millisecond):
		}
	}
}

// step draws one operation by weight; one that is not possible now (a
// cap reached, nothing to delete) draws again.
func (s *soak) step(ctx context.Context, seq int) {
	pods, err := s.list(ctx)
	if err != nil {
		s.count("list", err)
		return
	}
	by := map[string][]corev1.Pod{}
	for _, p := range pods {
		if p.DeletionTimestamp == nil {
			by[p.Labels[kindLabel]] = append(by[p.Labels[kindLabel]], p)
		}
	}
	deps, derr := s.client.AppsV1().Deployments(ns).List(ctx, metav1.ListOptions{})
	jobs, jerr := s.client.BatchV1().Jobs(ns).List(ctx, metav1.ListOptions{})
	if derr != nil || jerr != nil {
		s.count("list", errors.Join(derr, jerr))
		return
	}
	type op struct {
		name   string
		weight int
		ok     bool
		do     func() error
	}
	shape := func() map[string]string {
		out := map[string]string{}
		for k, v := range shapes[s.rng.Intn(len(shapes))] {
			out[k] = v
		}
		return out
	}
	pick := func(list []corev1.Pod) corev1.Pod { return list[s.rng.Intn(len(list))] }
	del := func(p corev1.Pod) error {
		s.mu.Lock()
		s.deletedByUs[p.Namespace+"/"+p.Name] = true
		s.mu.Unlock()
		grace := int64(s.rng.Intn(2))
		return s.client.CoreV1().Pods(ns).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace})
	}
	running := func(kind string) []corev1.Pod {
		var out []corev1.Pod
		for _, p := range by[kind] {
			if p.Status.Phase == corev1.PodRunning && api.HasDecision(p.Annotations) {
				out = append(out, p)
			}
		}
		return out
	}
	ops := []op{
		{"create-share", 30, len(by["bare"]) < maxBare, func() error {
			_, err := s.client.CoreV1().Pods(ns).Create(ctx, pod(fmt.Sprintf("share-%d", seq), "bare", shape()), metav1.CreateOptions{})
			return err
		}},
		{"delete-share", 18, len(by["bare"]) > 0, func() error { return del(pick(by["bare"])) }},
		{"create-whole", 3, len(by["whole"]) < maxWhole, func() error {
			p := pod(fmt.Sprintf("whole-%d", seq), "whole", nil)
			p.Spec.Containers[0].Resources.Limits = corev1.ResourceList{api.ResourceGPU: resource.MustParse("1")}
			_, err := s.client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})
			return err
		}},
		{"delete-whole", 3, len(by["whole"]) > 0, func() error { return del(pick(by["whole"])) }},
		{"create-deployment", 4, len(deps.Items) < maxDeployments, func() error {
			_, err := s.client.AppsV1().Deployments(ns).Create(ctx, deployment(fmt.Sprintf("dep-%d", seq), int32(1+s.rng.Intn(maxReplicas)), shape()), metav1.CreateOptions{})
			return err
		}},
		{"scale-deployment", 8, len(deps.Items) > 0, func() error {
			d := deps.Items[s.rng.Intn(len(deps.Items))]
			patch := fmt.Sprintf(`{"spec":{"replicas":%d}}`, s.rng.Intn(maxReplicas+1))
			_, err := s.client.AppsV1().Deployments(ns).Patch(ctx, d.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
			return err
		}},
		{"delete-deployment", 3, len(deps.Items) > 0, func() error {
			d := deps.Items[s.rng.Intn(len(deps.Items))]
			bg := metav1.DeletePropagationBackground
			return s.client.AppsV1().Deployments(ns).Delete(ctx, d.Name, metav1.DeleteOptions{PropagationPolicy: &bg})
		}},
		{"create-job", 4, len(jobs.Items) < maxJobs, func() error {
			_, err := s.client.BatchV1().Jobs(ns).Create(ctx, job(fmt.Sprintf("job-%d", seq), int32(2+s.rng.Intn(3)), shape()), metav1.CreateOptions{})
			return err
		}},
		{"delete-job", 3, len(jobs.Items) > 0, func() error {
			j := jobs.Items[s.rng.Intn(len(jobs.Items))]
			bg := metav1.DeletePropagationBackground
			return s.client.BatchV1().Jobs(ns).Delete(ctx, j.Name, metav1.DeleteOptions{PropagationPolicy: &bg})
		}},
		{"create-claim-pod", 4, len(by["claim"]) < maxClaimPods, func() error {
			p := pod(fmt.Sprintf("claim-%d", seq), "claim", nil)
			template := "quarter"
			p.Spec.ResourceClaims = []corev1.PodResourceClaim{{Name: "gpu", ResourceClaimTemplateName: &template}}
			p.Spec.Containers[0].Resources.Claims = []corev1.ResourceClaim{{Name: "gpu"}}
			_, err := s.client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})
			return err
		}},
		{"delete-claim-pod", 3, len(by["claim"]) > 0, func() error { return del(pick(by["claim"])) }},
		{"resize", 6, len(running("bare")) > 0, func() error { return s.resize(ctx, pick(running("bare"))) }},
	}
	total := 0
	for _, o := range ops {
		if o.ok {
			total += o.weight
		}
	}
	if total == 0 {
		return
	}
	n := s.rng.Intn(total)
	for _, o := range ops {
		if !o.ok {
			continue
		}
		if n -= o.weight; n < 0 {
			s.count(o.name, o.do())
			return
		}
	}
}

// resize asks a running share for more or less memory (request and limit
// alike), from half to one and a half times what it holds.
func (s *soak) resize(ctx context.Context, p corev1.Pod) error {
	as, err := api.ParseAssignments(p.Annotations)
	if err != nil || len(as) == 0 {
		return err
	}
	factor := []float64{0.5, 0.75, 1.25, 1.5}[s.rng.Intn(4)]
	mib := max(int64(float64(as[0].RequestMiB)*factor)/1024*1024, 1024)
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"%dMi",%q:"%dMi"}}}`, api.KeyResizeRequest, mib, api.KeyResizeLimit, mib)
	_, err = s.client.CoreV1().Pods(ns).Patch(ctx, p.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
	return err
}
